"""LoRA adapters served end to end: a real ``tpserve serve --enable-lora`` at tp 2 (engine
process, memory plan, step loop) with two PEFT adapters on a tiny Llama, driven by the
``openai`` client. Requests naming the base model and each adapter run together; each
gets PEFT's own greedy tokens and log-probabilities for its adapter; a prompt cached under
one model is not reused under another (the prefix cache keys on the adapter); /v1/models
lists the adapters under their base model; an unknown model is a 404; /metrics names the
adapters with running requests; the KV pool ends free; adapters load and unload while
serving (vLLM's runtime routes). The flags resolve to the runner's config and bad ones
stop the start naming them."""

from __future__ import annotations

import copy
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.model.test_lora import ADAPTERS, _hf, save_adapter
from tests.server.serverproc import ServerProcess, stopped_on_exit
from tests.server.test_gemma_server import FLAGS, NEW_TOKENS, _greedy
from tests.test_cli import _cfg
from tpserve.server.config import RUNTIME_LORA_ENV

peft = pytest.importorskip("peft")

# the second prompt fills two KV blocks of 16: a prefix-cache hit if keys ignored adapters
PROMPTS = [[5, 9, 13, 200], [(7 * i + 3) % 256 for i in range(36)]]
MODELS = ("tiny", "a", "b")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-served")
    hf = _hf("llama")
    folders = {n: save_adapter(hf, root / n, 90 + i, **c)
               for i, (n, c) in enumerate(ADAPTERS.items())}
    return root, hf, folders


@pytest.fixture(scope="module")
def served(adapters, smollm2_tokenizer):
    root, hf, folders = adapters
    base = root / "base"
    hf.save_pretrained(base)
    smollm2_tokenizer.save_pretrained(base)  # its first 256 ids are the tiny vocab
    server = ServerProcess(str(base), *FLAGS, "--enable-lora", "--lora-modules",
                           f"a={folders['a']}",
                           f'{{"name": "b", "path": "{folders["b"]}", '
                           f'"base_model_name": "tiny-base"}}', "--max-lora-rank", "8",
                           wait=False)
    # two slots, adapter a in one: b (and others) loaded and unloaded while serving, b
    # also by repository id from an offline Hugging Face cache; two data-parallel replicas,
    # so every load and unload must reach both (a request may go to either)
    cache = root / "hub-cache"
    cache_snapshot(cache, "tpserve-test/tiny-lora-b", folders["b"])
    runtime = ServerProcess(str(base), *FLAGS, "--enable-lora", "--lora-modules",
                            f"a={folders['a']}", "--max-loras", "2", "--max-lora-rank", "8",
                            "--data-parallel-size", "2",
                            "--download-dir", str(cache),
                            env={RUNTIME_LORA_ENV: "True", "HF_HUB_OFFLINE": "1"}, wait=False)
    oracle = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(folders["a"]),
                                            adapter_name="a")
    oracle.load_adapter(str(folders["b"]), adapter_name="b")
    want = {}
    for name in ("a", "b"):
        oracle.set_adapter(name)
        want[name] = [_greedy(oracle, p) for p in PROMPTS]
    want["tiny"] = [_greedy(hf, p) for p in PROMPTS]
    with stopped_on_exit({"lora": server, "runtime": runtime}) as started:
        started["runtime"].wait_until_healthy()
        yield started["lora"].wait_until_healthy(), want, folders, started["runtime"]


def cache_snapshot(cache: Path, repo_id: str, folder: Path) -> Path:
    """``folder`` as the one snapshot of ``repo_id`` in the Hugging Face cache ``cache``
    (the hub's layout: its ``main`` ref naming the snapshot), so offline fetches find it."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def _complete(client, model, prompt):
    return client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                      temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})


def _check(answer, want):
    ids, lps = want
    choice = answer.choices[0]
    assert choice.model_extra["token_ids"] == ids
    assert choice.logprobs.token_logprobs == pytest.approx(lps, abs=1e-4)


def test_each_model_name_gets_its_adapters_tokens(served):
    server, want, _, _ = served
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", timeout=120,
                           max_retries=0)  # a failed request must not be retried elsewhere
    for name in MODELS:  # adapters really change the answers of this test
        assert name == "tiny" or want[name] != want["tiny"]
    jobs = [(m, i) for m in MODELS for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(jobs)) as pool:  # batched together: slots mixed in steps
        answers = list(pool.map(lambda j: _complete(client, j[0], PROMPTS[j[1]]), jobs))
    for (model, i), answer in zip(jobs, answers, strict=True):
        assert answer.model == model
        _check(answer, want[model][i])
    # one after another on the two-block prompt: each finds the others' blocks cached
    for model in ("tiny", "a", "b", "a", "tiny"):
        _check(_complete(client, model, PROMPTS[1]), want[model][1])
    server.wait_pool_free()


def test_models_list_the_adapters_and_unknown_names_are_404(served):
    server, _, folders, _ = served
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", timeout=60)
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["tiny", "a", "b"]
    assert cards["a"].model_extra["parent"] == "tiny" and cards["a"].root == str(folders["a"])
    assert cards["b"].model_extra["parent"] == "tiny-base"
    assert client.models.retrieve("b").root == str(folders["b"])
    with pytest.raises(openai.NotFoundError, match="The model `c` does not exist"):
        _complete(client, "c", PROMPTS[0])


def test_flags_resolve_to_the_runner_config(adapters, tmp_path):
    _, _, folders = adapters
    lora = _cfg("--enable-lora", "--lora-modules", f"x={folders['a']}", f"y={folders['b']}",
                "--max-lora-rank", "8").runner.lora
    assert [(m.name, m.path) for m in lora.modules] == [("x", str(folders["a"])),
                                                       ("y", str(folders["b"]))]
    assert (lora.max_loras, lora.max_lora_rank) == (2, 8)
    assert _cfg("--enable-lora", "--max-loras", "4").runner.lora.max_loras == 4
    assert _cfg().runner.lora is None
    taken = _cfg("--enable-lora", "--lora-modules", f"x={folders['a']}", "--max-cpu-loras",
                 "8", "--lora-dtype", "fp32").runner.lora  # the model's dtype on CPU
    assert (taken.max_loras, [m.name for m in taken.modules]) == (1, ["x"])
    fp8 = _cfg("--enable-lora", "--lora-modules", f"x={folders['a']}", "--quantization", "fp8")
    assert fp8.runner.quantization == "fp8" and fp8.runner.lora.max_loras == 1
    bad = {
        ("--lora-modules", f"x={folders['a']}"): "--lora-modules needs --enable-lora",
        ("--enable-lora", "--lora-modules", "x"): "expected NAME=PATH",
        ("--enable-lora", "--lora-modules", '{"name": "x"}'): 'needs "name" and "path"',
        ("--enable-lora", "--lora-modules", f"x={tmp_path / 'none'}"): "not a folder",
        ("--enable-lora", "--lora-modules", f"x={folders['b']}", "--max-lora-rank", "4"):
            "--lora-modules x: .*rank 8 exceeds --max-lora-rank 4",
        ("--enable-lora", "--lora-modules", f"x={folders['a']}", f"x={folders['b']}",
         "--max-lora-rank", "8"): "names an adapter twice",
        ("--enable-lora", "--lora-modules", f"x={folders['a']}", f"y={folders['b']}",
         "--max-loras", "1", "--max-lora-rank", "8"): "--max-loras is 1",
        ("--enable-lora", "--lora-modules", f"SmolLM2-135M-Instruct={folders['a']}"):
            "is the served model's name",
        ("--enable-lora", "--runner", "pooling"): "--runner pooling",
        # vLLM's other LoRA flags: checked, or refused where tpserve cannot honour them
        ("--enable-lora", "--lora-modules", f"x={folders['a']}", "--max-cpu-loras", "0"):
            "--max-cpu-loras 0 must be at least --max-loras \\(1\\)",
        ("--enable-lora", "--lora-dtype", "float16"): "--lora-dtype float16: the adapters "
                                                      "are held in the model's dtype",
        ("--enable-lora", "--fully-sharded-loras"): "--fully-sharded-loras: not supported",
        ("--max-cpu-loras", "4"): "--max-cpu-loras needs --enable-lora",
    }
    for argv, message in bad.items():
        with pytest.raises(ValueError, match=message):
            _cfg(*argv)


def _post(server, route: str, **body) -> httpx.Response:
    return httpx.post(f"{server.base}/v1/{route}", json=body, timeout=120)


def test_adapters_load_and_unload_while_serving(served, tmp_path):
    """vLLM's runtime routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), on two data-parallel
    replicas at tp 2 each: b loads into the free slot of both and answers as PEFT's b; a third adapter finds no slot; unloading b frees
    it (its name then a 404), and an adapter loaded there next (a's folder as "c") answers
    as a, not from b's cached blocks of the same prompt; what cannot load is a 400 that
    leaves the slot free, and a path that holds no adapter (no folder, no adapter_config.json,
    a repository id the cache lacks) vLLM's 404 "No adapter found"; b named by repository id
    loads from the Hugging Face cache. A server started without the variable refuses both
    routes."""
    static, want, folders, server = served
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", timeout=120,
                           max_retries=0)  # a failed request must not be retried elsewhere
    assert [m.id for m in client.models.list().data] == ["tiny", "a"]
    r = _post(server, "load_lora_adapter", lora_name="b", lora_path=str(folders["b"]))
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'b' added successfully.")
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b"]
    _check(_complete(client, "b", PROMPTS[1]), want["b"][1])  # its blocks now cached
    _check(_complete(client, "a", PROMPTS[1]), want["a"][1])
    for name, path, status, message in (
            ("c", folders["a"], 400, "every one of the 2 LoRA slots"),
            ("a", folders["b"], 400, "The lora adapter 'a' has already been loaded."),
            ("tiny", folders["b"], 400, "already been loaded")):
        r = _post(server, "load_lora_adapter", lora_name=name, lora_path=str(path))
        assert r.status_code == status and message in r.json()["error"]["message"], r.text
    r = _post(server, "unload_lora_adapter", lora_name="b")
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'b' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        _complete(client, "b", PROMPTS[0])
    assert _post(server, "unload_lora_adapter", lora_name="b").status_code == 404
    r = _post(server, "load_lora_adapter", lora_name="d", lora_path=str(tmp_path))
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    assert "No adapter found" in r.text and "no adapter_config.json" in r.text, r.text
    garbage = tmp_path / "garbage"  # weights safetensors cannot read: a 400, served on
    shutil.copytree(folders["a"], garbage)
    (garbage / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    r = _post(server, "load_lora_adapter", lora_name="d", lora_path=str(garbage))
    assert r.status_code == 400 and "cannot be read" in r.json()["error"]["message"], r.text
    r = _post(server, "load_lora_adapter", lora_name="c", lora_path=str(folders["a"]))
    assert r.status_code == 200, r.text
    _check(_complete(client, "c", PROMPTS[1]), want["a"][1])
    _check(_complete(client, "a", PROMPTS[0]), want["a"][0])
    _check(_complete(client, "tiny", PROMPTS[1]), want["tiny"][1])
    # a repository id, as vLLM takes one: fetched from the (offline) cache
    assert _post(server, "unload_lora_adapter", lora_name="c").status_code == 200
    r = _post(server, "load_lora_adapter", lora_name="hub-b",
              lora_path="tpserve-test/tiny-lora-b")
    assert r.status_code == 200, r.text
    _check(_complete(client, "hub-b", PROMPTS[0]), want["b"][0])
    # vLLM's load_inplace: hub-b's name moves to a's weights; loaded beside the old ones,
    # so it needs a free slot (both hold adapters: a 400 naming it)
    r = _post(server, "load_lora_adapter", lora_name="hub-b", lora_path=str(folders["a"]))
    assert r.status_code == 400 and "set 'load_inplace' to True" in r.text, r.text
    swap = dict(lora_name="hub-b", lora_path=str(folders["a"]), load_inplace=True)
    r = _post(server, "load_lora_adapter", **swap)
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_inplace", r.text
    assert _post(server, "unload_lora_adapter", lora_name="a").status_code == 200
    r = _post(server, "load_lora_adapter", **swap)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'hub-b' added successfully.")
    assert [m.id for m in client.models.list().data] == ["tiny", "hub-b"]
    _check(_complete(client, "hub-b", PROMPTS[0]), want["a"][0])
    r = _post(server, "load_lora_adapter", **swap)  # the slot it left is free again
    assert r.status_code == 200, r.text
    r = _post(server, "load_lora_adapter", lora_name="e", lora_path="tpserve-test/none")
    assert r.status_code == 404 and "'tpserve-test/none'" in r.json()["error"]["message"]
    r = _post(server, "load_lora_adapter", lora_name="e", lora_path=str(tmp_path / "no"))
    assert r.status_code == 404 and "No adapter found for" in r.text, r.text
    server.wait_pool_free()
    r = _post(static, "load_lora_adapter", lora_name="x", lora_path=str(folders["a"]))
    assert r.status_code == 400 and "runtime LoRA updates are off" in r.text
    assert _post(static, "unload_lora_adapter", lora_name="a").status_code == 400


def _lora_info(server) -> dict[str, str]:
    """The labels of /metrics' ``tpserve:lora_requests_info`` sample."""
    text = httpx.get(server.base + "/metrics", timeout=10).text
    (line,) = [x for x in text.splitlines() if x.startswith("tpserve:lora_requests_info{")]
    labels = line[line.index("{") + 1:line.index("}")]
    return dict((k, v.strip('"')) for k, v in (p.split("=", 1) for p in labels.split('",')))


def test_metrics_name_the_adapters_with_running_requests(served):
    """vLLM's ``lora_requests_info``: while a request under b streams, b is listed as
    running (by name; the engine process sends its figures every 0.5 s, so they are read
    until they show it, at most once per streamed token); once it is done, none is."""
    server, want, _, _ = served
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", timeout=120,
                           max_retries=0)  # a failed request must not be retried elsewhere
    stream = client.completions.create(model="b", prompt=PROMPTS[0],
                                       max_tokens=250 - len(PROMPTS[0]), temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    seen = None
    for _ in stream:
        seen = _lora_info(server)
        if seen["running_lora_adapters"]:
            break
    assert seen == {"max_lora": "2", "running_lora_adapters": "b",
                    "waiting_lora_adapters": ""}
    assert sum(1 for _ in stream) > 0  # it was still running
    server.wait_pool_free()
    assert _lora_info(server)["running_lora_adapters"] == ""


def test_an_adapter_named_by_repository_id_is_served_from_the_cache(adapters, tmp_path,
                                                                    monkeypatch):
    """``--lora-modules x=org/name``: the adapter's snapshot in the Hugging Face cache
    (``--download-dir``; offline, a cache hit), as vLLM takes a repository id; one the
    cache lacks stops the start naming it."""
    import huggingface_hub.constants

    _, _, folders = adapters
    snapshot = cache_snapshot(tmp_path, "tpserve-test/tiny-lora", folders["a"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    lora = _cfg("--enable-lora", "--lora-modules", "x=tpserve-test/tiny-lora",
                "--download-dir", str(tmp_path)).runner.lora
    assert lora.modules[0].name == "x"
    assert lora.modules[0].path == str(snapshot)
    with pytest.raises(FileNotFoundError, match="'tpserve-test/none'"):
        _cfg("--enable-lora", "--lora-modules", "x=tpserve-test/none", "--download-dir",
             str(tmp_path))
