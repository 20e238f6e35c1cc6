"""Schemathesis hooks for test_schemathesis (loaded through ``SCHEMATHESIS_HOOKS``).

Generated bodies that would make the model write many tokens get a small ``max_tokens``
so that a CPU run stays short: a missing or null ``max_tokens`` / ``max_completion_tokens``
/ ``max_output_tokens`` (which means "the rest of the context") and an integer between the cap and the context
length. Values over the context length, negative, or not integers are sent unchanged:
the server must answer them with a quick 400.
"""

from __future__ import annotations

import os

import schemathesis

# 2: the first token (from the prefill) and one decode step; each further token cost about
# 80 ms of a CPU core on SmolLM2, about 30 s of the run at 4
CAP = int(os.environ.get("TPSERVE_FUZZ_MAX_TOKENS", "2"))
MAX_MODEL_LEN = int(os.environ.get("TPSERVE_FUZZ_MAX_MODEL_LEN", "256"))
GENERATING = {"/v1/completions": ("max_tokens",),
              "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
              "/v1/responses": ("max_output_tokens",), "/v1/messages": ("max_tokens",),
              "/invocations": ("max_tokens",)}


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    fields = GENERATING.get(case.operation.path)
    if fields is None or not isinstance(case.body, dict):
        return
    for name in fields:
        value = case.body.get(name)
        if value is None:
            case.body[name] = CAP
        elif type(value) is int and CAP < value <= MAX_MODEL_LEN:
            case.body[name] = CAP
