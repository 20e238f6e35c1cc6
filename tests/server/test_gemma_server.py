"""Gemma served end to end: a real ``tpserve serve`` at tp 2 (engine process, the memory
plan, the step loop) on tiny Gemma 2 and Gemma 3 checkpoints (a multimodal
``Gemma3ForConditionalGeneration`` folder: its language model alone), driven by the
``openai`` client; greedy tokens and their log-probabilities equal transformers' own
generation from the same prompt ids."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.model.test_gemma import _hf_model, multimodal_gemma3
from tests.server.serverproc import ServerProcess, stopped_on_exit

PROMPTS = [[5, 9, 13, 200], [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12]]
NEW_TOKENS = 10
FLAGS = ("--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
         "--tensor-parallel-size", "2", "--check-integrity")


def _greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``prompt`` and each token's log-probability."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          output_scores=True, return_dict_in_generate=True,
                          min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    ids = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, ids,
                                                                           strict=True)]
    return ids, lps


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_tokenizer):
    """kind -> (server, transformers' answers); both servers start before either is
    waited for."""
    models = {"gemma2": _hf_model("gemma2"), "gemma3-multimodal": multimodal_gemma3(44)}
    servers, want = {}, {}
    for kind, hf in models.items():
        folder = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(folder)  # transformers' own file layout and names
        smollm2_tokenizer.save_pretrained(folder)  # its first 256 ids are the tiny vocab
        servers[kind] = ServerProcess(str(folder), *FLAGS, wait=False)
        want[kind] = [_greedy(hf, p) for p in PROMPTS]
    with stopped_on_exit(servers) as started:
        yield {kind: (started[kind].wait_until_healthy(), want[kind]) for kind in models}


@pytest.mark.parametrize("kind", ["gemma2", "gemma3-multimodal"])
def test_gemma_serves_transformers_greedy_tokens(served, kind):
    server, want = served[kind]
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", timeout=120)
    for prompt, (ids, lps) in zip(PROMPTS, want, strict=True):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS,
                                      temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True,
                                                  "return_token_ids": True})
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == ids, kind
        assert choice.logprobs.token_logprobs == pytest.approx(lps, abs=1e-4)
