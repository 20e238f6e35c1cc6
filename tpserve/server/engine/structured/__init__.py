"""Structured output: grammars compiled with xgrammar on a worker thread (the engine
thread never waits for a compile), one matcher per constrained sequence, and the packed
token bitmask of a step's constrained rows (built on the host)."""
