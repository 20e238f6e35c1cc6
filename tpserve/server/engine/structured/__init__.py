"""Structured output: grammars compiled with xgrammar, one matcher per constrained
sequence, and the packed token bitmask of a step's constrained rows (built on the host)."""
