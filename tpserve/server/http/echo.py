"""The completions API's ``echo``: each choice's text starts with its prompt, and with
``logprobs`` its logprobs start with the prompt's tokens, scored by the model (the first
token has none: null), as OpenAI's legacy completions and vLLM answer. ``max_tokens: 0``
with ``echo`` returns the prompt alone (the engine still samples one token, which is
dropped and not counted). What lm-eval's loglikelihood and perplexity tasks send."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from tpserve.server.engine.outputs import TokenLogprob
from tpserve.server.http.openai_format import completion_logprobs
from tpserve.server.http.prompts import PromptProcessor
from tpserve.server.http.protocol import CompletionRequest
from tpserve.server.http.replies import CompletionLogprobs


@dataclass(frozen=True)
class Echo:
    """Per prompt of the request: its text and its first token's text; choice ``i``
    echoes prompt ``i // per_prompt``. ``only``: ``max_tokens`` was 0. ``top``: the
    request's ``logprobs`` (its scored prompt may hold more alternatives, for vLLM's
    ``prompt_logprobs``)."""

    texts: tuple[str, ...]
    first_tokens: tuple[str, ...]
    per_prompt: int
    only: bool
    top: int = 0

    def text(self, choice: int) -> str:
        return self.texts[choice // self.per_prompt]

    def logprobs(self, choice: int, scored: Sequence[TokenLogprob]) -> CompletionLogprobs:
        """The echoed prompt's logprobs: its first token unscored, then ``scored``."""
        first = self.first_tokens[choice // self.per_prompt]
        out = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None],
                                 text_offset=[0])
        cut = [replace(lp, top=lp.top[:self.top]) for lp in scored]
        return joined(out, completion_logprobs(cut, len(first)))

    def joined_with(self, choice: int, scored: Sequence[TokenLogprob],
                    generated: Sequence[TokenLogprob]) -> CompletionLogprobs:
        """The prompt's logprobs, then the generated tokens', offsets after the prompt."""
        return joined(self.logprobs(choice, scored),
                      completion_logprobs(generated, len(self.text(choice))))


def joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)


async def plan_echo(body: CompletionRequest, prompt_ids: list[list[int]],
                    prompts: PromptProcessor, n: int) -> Echo | None:
    """The request's ``Echo`` (None without ``echo``): string prompts echo as sent, token
    prompts (and truncated ones) as decoded."""
    if not body.echo:
        return None
    raw = body.prompt if isinstance(body.prompt, list) and body.prompt and isinstance(
        body.prompt[0], str | list) else [body.prompt]
    whole = body.truncate_prompt_tokens is None
    texts = [p if isinstance(p, str) and whole else await prompts.decode(ids)
             for p, ids in zip(raw, prompt_ids, strict=True)]
    firsts = [f"token_id:{ids[0]}" if body.return_tokens_as_token_ids
              else await prompts.decode(ids[:1]) for ids in prompt_ids]
    return Echo(tuple(texts), tuple(firsts), n, body.max_tokens == 0, body.logprobs or 0)
