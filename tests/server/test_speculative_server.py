"""Speculative decoding (``--speculative-config``, method "ngram") through a real ``tpserve
serve`` of the embedded SmolLM2 at tp 2 (gloo ranks), driven by the real openai client:
greedy answers equal the model's greedy tokens without speculation, streamed or not, a stop
string inside a kept draft ends the text there, drafts are kept (/metrics, by position
too), and every block is back in the pool afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.model.util import greedy_answers
from tests.server.engine.test_speculative import COUNTING
from tests.server.serverproc import SMALL, ServerProcess

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
PROMPTS = [COUNTING, "def fibonacci(n):\n    if n < 2:\n        return n",
           "<|im_start|>user\nWrite a haiku about GPUs.<|im_end|>\n<|im_start|>assistant\n"]
TOKENS = 24


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*SMALL, "--tensor-parallel-size", "2", "--speculative-config", SPEC,
                      "--served-model-name", "smol")
    yield s
    assert s.stop() == 0, s.output()


def test_greedy_answers_are_the_models_without_speculation(server, smollm2_path,
                                                            smollm2_tokenizer):
    ids, want = greedy_answers(smollm2_path, smollm2_tokenizer, PROMPTS, TOKENS)
    client = server.client()

    def complete(prompt: list[int]) -> str:
        answer = client.completions.create(model="smol", prompt=prompt, max_tokens=TOKENS,
                                           temperature=0)
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage.completion_tokens == TOKENS
        return answer.choices[0].text

    with ThreadPoolExecutor(len(ids)) as pool:  # batched: drafts beside plain decodes
        got = list(pool.map(complete, ids))
    assert got == want
    streamed = client.completions.create(model="smol", prompt=ids[0], max_tokens=TOKENS,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want[0]
    drafted = server.metric("spec_decode_num_draft_tokens_total")
    accepted = server.metric("spec_decode_num_accepted_tokens_total")
    drafts = server.metric("spec_decode_num_drafts_total")
    assert 0 < accepted <= drafted and drafts <= drafted
    # vLLM's per-position counter: position j counts drafts whose first j + 1 tokens were
    # kept, so it never grows with j; the positions sum to the kept tokens
    per_pos = _per_position(server)
    assert sorted(per_pos) == [0, 1, 2, 3]
    counts = [per_pos[j] for j in range(4)]
    assert drafts >= counts[0] > 0 and counts == sorted(counts, reverse=True)
    assert sum(counts) == accepted
    server.wait_pool_free()


def _per_position(server) -> dict[int, float]:
    """``tpserve:spec_decode_num_accepted_tokens_per_pos_total`` by its position label."""
    text = httpx.get(server.base + "/metrics", timeout=10).text
    return {int(sample.labels["position"]): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == "tpserve:spec_decode_num_accepted_tokens_per_pos_total"}


def test_a_stop_string_inside_a_kept_draft_ends_the_text_there(server):
    """After the prefill's " five", the draft " six seven eight nine" is kept whole; the
    stop string " eight" ends the text before it (the engine-level test shows the deltas)."""
    client = server.client()
    answer = client.completions.create(model="smol", prompt=COUNTING, max_tokens=12,
                                       temperature=0, stop=[" eight"])
    assert answer.choices[0].text == " five six seven"
    assert answer.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Repeat: " + COUNTING}],
        max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert chat.choices[0].finish_reason == "stop"  # EOS: in the log-probabilities only
    assert "".join(t.token for t in content) == chat.choices[0].message.content + "<|im_end|>"
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    server.wait_pool_free()
