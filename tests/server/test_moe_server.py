"""A mixture of experts served end to end: a real ``tpserve serve`` at tp 2 (engine
process, memory plan, step loop) on a tiny Qwen2-MoE checkpoint (a shared expert, a dense
layer, experts split over the ranks by their columns, or whole with
``--enable-expert-parallel``), driven by the ``openai`` client, several requests at once;
greedy tokens and their log-probabilities equal transformers' own generation from the same
prompt ids, and the KV pool ends free."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.model.test_moe import _hf_moe
from tests.server.serverproc import ServerProcess, stopped_on_exit
from tests.server.test_gemma_server import FLAGS, NEW_TOKENS, PROMPTS, _greedy


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_tokenizer):
    hf = _hf_moe("qwen2_moe")
    folder = tmp_path_factory.mktemp("qwen2_moe")
    hf.save_pretrained(folder)  # transformers' own file layout and names
    smollm2_tokenizer.save_pretrained(folder)  # its first 256 ids are the tiny vocab
    servers = {"columns": ServerProcess(str(folder), *FLAGS, wait=False),
               "experts": ServerProcess(str(folder), *FLAGS, "--enable-expert-parallel",
                                        wait=False)}
    want = [_greedy(hf, p) for p in PROMPTS]
    with stopped_on_exit(servers) as started:
        yield {k: started[k].wait_until_healthy() for k in servers}, want


@pytest.mark.parametrize("split", ["columns", "experts"])
def test_moe_serves_transformers_greedy_tokens(served, split):
    servers, want = served
    server = servers[split]
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", timeout=120)

    def complete(prompt):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS,
                                          temperature=0, logprobs=1,
                                          extra_body={"ignore_eos": True,
                                                      "return_token_ids": True})

    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:  # batched together, twice each
        answers = list(pool.map(complete, PROMPTS * 2))
    for r, (ids, lps) in zip(answers, want * 2, strict=True):
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == ids
        assert choice.logprobs.token_logprobs == pytest.approx(lps, abs=1e-4)
    server.wait_pool_free()
