"""LoRA adapters written by PEFT (``save_pretrained``) on tiny random Llama, Qwen2 (biased
q/k/v), Phi-3 (fused q/k/v and gate/up: one A for the parts) and Qwen2-MoE (its shared
expert's and dense layer's projections; routed experts are not LoRA targets) checkpoints:
one step holding sequences under two adapters and the base model gives, row for row,
PEFT's own logits with that adapter active (or disabled) in float32, prefilled whole, in
chunks and decoded; Llama at tp 1, 2 and 3 (tp 3 pads heads and MLP columns, and the
adapters' shards with them) and sequence parallel at tp 2, the others at tp 1 and 3.
Adapter "a" has rank 4 on all seven projections (Phi-3: its four); "b" rank 8, rsLoRA, on
q, v and down only (Phi-3: qkv and down); a third slot stays empty. A step without
adapters gets exactly the model without LoRA; what tpserve cannot apply is refused by
name."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.model.test_tiny_models import TINY
from tests.model.util import CPU, load, new_pool, save_hf_folder, tiny_hf_model
from tpserve.model.lora.adapter import LoraConfig, LoraModule, read_adapter
from tpserve.model.lora.attach import attach_lora, lora_layers
from tpserve.model.plan import SeqChunk, StepPlan
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.lora import LoraBatch

peft = pytest.importorskip("peft")

TOKENS = [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12, 33, 71, 140, 2, 60, 61, 8]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"a": dict(r=4, lora_alpha=8, target_modules=ALL),
            "b": dict(r=8, lora_alpha=4, use_rslora=True,
                      target_modules=["q_proj", "v_proj", "down_proj"])}
# Phi-3's projections are fused: one A for q, k and v (gate and up), B's rows stacked
PHI3_ADAPTERS = {"a": dict(r=4, lora_alpha=8,
                           target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
                 "b": dict(r=8, lora_alpha=4, use_rslora=True,
                           target_modules=["qkv_proj", "down_proj"])}
SLOTS = (0, 1, -1)  # the sequences of each step: adapter a, adapter b, the base model
MAX_RANK = 8


def _hf(kind: str):
    import transformers as tf

    if kind == "qwen2_moe":  # a shared expert and a dense layer LoRA applies to
        from tests.model.test_moe import _hf_moe

        return _hf_moe("qwen2_moe")
    torch.manual_seed({"llama": 80, "qwen2": 81, "phi3": 82}[kind])
    if kind == "llama":
        return tiny_hf_model(tf.LlamaConfig(**TINY, rope_theta=10000.0), "LlamaForCausalLM")
    if kind == "phi3":
        return tiny_hf_model(tf.Phi3Config(**TINY, rope_theta=10000.0, pad_token_id=0),
                             "Phi3ForCausalLM")
    return tiny_hf_model(tf.Qwen2Config(**TINY, rope_theta=10000.0), "Qwen2ForCausalLM",
                         biases=True)


@torch.no_grad()
def save_adapter(hf, folder: Path, seed: int, **config) -> Path:
    """PEFT's adapter of ``config`` on a copy of ``hf``, both its matrices random (PEFT
    starts B at zero), saved as PEFT saves it."""
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(**config))
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(str(folder))
    return folder


@torch.no_grad()
def peft_logits(hf, folders: dict[str, Path], tokens: list[int]) -> dict:
    """Every position's logits under each adapter (PEFT applying it) and without any."""
    model = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(folders["a"]),
                                           adapter_name="a")
    model.load_adapter(str(folders["b"]), adapter_name="b")
    x = torch.tensor([tokens])
    want = {}
    for name in folders:
        model.set_adapter(name)
        want[name] = model(x).logits[0]
    with model.disable_adapter():
        want[None] = model(x).logits[0]
    return want


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(kind):
        if kind not in made:
            root = tmp_path_factory.mktemp(f"lora-{kind}")
            hf = _hf(kind)
            folder = save_hf_folder(hf, root / "base")
            configs = PHI3_ADAPTERS if kind == "phi3" else ADAPTERS
            folders = {n: save_adapter(hf, root / n, 90 + i, **c)
                       for i, (n, c) in enumerate(configs.items())}
            made[kind] = str(folder), folders, peft_logits(hf, folders, TOKENS)
        return made[kind]
    return get


def lora_config(folders: dict[str, Path], max_loras: int = 3) -> LoraConfig:
    return LoraConfig(tuple(LoraModule(n, str(f)) for n, f in folders.items()), max_loras,
                      MAX_RANK)


def with_lora(folder: str, folders, group=None, tp_comm: str = "allreduce", quant_method=None):
    model, comm = load(folder, group, tp_comm=tp_comm, quant_method=quant_method)
    batch = LoraBatch(256, 3, MAX_RANK, torch.float32, CPU)
    attach_lora(model, lora_config(folders), batch)
    return model, comm, batch


@torch.no_grad()
def run_step(model, batch: LoraBatch | None, pool, chunks: list[SeqChunk]) -> torch.Tensor:
    """Every new token's logits of one step, the batch's slots set from the plan as the
    runner sets them."""
    attn = model.attn_backend
    plan = StepPlan.build(chunks, pool.block_size, attn)
    if batch is not None:
        batch.set(plan.lora_slots, plan.lora_slots.shape[0] > 0)
    hidden = model(plan.input_ids, plan.positions, pool.layers, plan.metadata(attn))
    return model.compute_logits(hidden)


def _per_sequence(logits: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(logits.split(sizes))


def _steps(group, folder: str, folders, tp_comm: str, quant_method=None
           ) -> list[list[torch.Tensor]]:
    """Each sequence's logits at every position two ways: the three sequences prefilled
    whole in one step; and together in steps of 7 and 8 prompt tokens, then decodes."""
    model, comm, batch = with_lora(folder, folders, group, tp_comm, quant_method)
    n = len(TOKENS)
    per = -(-n // 16)
    blocks = [list(range(i * per, (i + 1) * per)) for i in range(len(SLOTS))]
    pool = new_pool(model, comm)
    whole = _per_sequence(run_step(model, batch, pool, [
        SeqChunk(TOKENS, 0, blocks[i], True, lora_slot=s) for i, s in enumerate(SLOTS)]),
        [n] * len(SLOTS))
    pool = new_pool(model, comm)
    stepped: list[list[torch.Tensor]] = [[] for _ in SLOTS]
    cuts = [(0, 7), (7, 15)] + [(p, p + 1) for p in range(15, n)]
    for lo, hi in cuts:
        out = run_step(model, batch, pool, [
            SeqChunk(TOKENS[lo:hi], lo, blocks[i], True, lora_slot=s)
            for i, s in enumerate(SLOTS)])
        for i, part in enumerate(_per_sequence(out, [hi - lo] * len(SLOTS))):
            stepped[i].append(part)
    return [whole, [torch.cat(p) for p in stepped]]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "phi3", "qwen2_moe"])
def test_adapters_equal_peft(checkpoints, kind):
    folder, folders, want = checkpoints(kind)
    rows = [want["a"], want["b"], want[None]]
    for name in ("a", "b"):  # each adapter really changes the answer
        assert (want[name] - want[None]).abs().max().item() > 0.1
    layouts = ((1, "allreduce"), (2, "allreduce"), (3, "allreduce"), (2, "allgather"))
    if kind != "llama":  # the sharding is Llama's: tp 3 (padded) is the other families' case
        layouts = layouts[::2]
    for tp, tp_comm in layouts:
        for whole, stepped in run_ranks(_steps, tp, folder, folders, tp_comm):
            for got_whole, got_stepped, w, slot in zip(whole, stepped, rows, SLOTS,
                                                       strict=True):
                assert (got_whole - w).abs().max().item() < 1e-4, (kind, tp, tp_comm, slot)
                assert (got_stepped - w).abs().max().item() < 1e-4, (kind, tp, tp_comm, slot)


def test_the_base_model_is_unchanged(checkpoints):
    """With the slots attached, a step with no adapter (the layers skip them) gives exactly
    the logits of the model without LoRA, and a step whose tokens are all on the base model
    (the products run, masked, as CUDA graphs replay such a step) the same within float32
    rounding (the layer's product is then one with its adapters' A rows)."""
    folder, folders, _ = checkpoints("llama")
    plain, comm = load(folder)
    model, _, batch = with_lora(folder, folders)
    chunk = [SeqChunk(TOKENS, 0, [0, 1], True)]
    want = run_step(plain, None, new_pool(plain, comm), chunk)
    assert torch.equal(run_step(model, batch, new_pool(model, comm), chunk), want)
    assert not batch.active
    batch.set(None, True)  # as CUDA graphs replay a step without adapters
    plan = StepPlan.build(chunk, 16, model.attn_backend)
    with torch.no_grad():
        hidden = model(plan.input_ids, plan.positions, new_pool(model, comm).layers,
                       plan.metadata(model.attn_backend))
        torch.testing.assert_close(model.compute_logits(hidden), want, atol=1e-5, rtol=0)


def test_slots_cover_every_projection(checkpoints):
    """Every attention and MLP projection carries max_loras slots of the max rank; adapter
    b's layers outside its targets, and the empty third slot, are zero."""
    folder, folders, _ = checkpoints("llama")
    model, _, _ = with_lora(folder, folders)
    layers = lora_layers(model)
    assert sorted({name.rpartition(".")[2] for name in layers}) == [
        "down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert len(layers) == 4 * TINY["num_hidden_layers"]
    qkv = layers["model.layers.0.self_attn.qkv_proj"].lora
    assert qkv.a.shape == (3 * 3 * MAX_RANK, TINY["hidden_size"])
    # the layer's weight and the slots' A rows are one tensor, counted once
    assert qkv.w_ext.data_ptr() == layers["model.layers.0.self_attn.qkv_proj"].weight.data_ptr()
    assert qkv.a.data_ptr() == qkv.w_ext[qkv.rows:].data_ptr()
    k_b = qkv.b[:, qkv.columns(1, "k")]
    assert not k_b.any() and not qkv.a[qkv.columns(1, "k")].any()  # b has no k_proj
    assert qkv.a[qkv.columns(0, "k")][:4].any()
    assert not qkv.a[qkv.columns(0, "k")][4:].any()  # rank 4 of 8: padded with zeros
    assert not qkv.a[2 * 3 * MAX_RANK:].any() and not qkv.b[:, 2 * 3 * MAX_RANK:].any()


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_refusals(checkpoints, tmp_path):
    """Each adapter tpserve cannot apply as PEFT would is refused, naming why."""
    import shutil

    folder, folders, _ = checkpoints("llama")

    def variant(name: str, **changes) -> Path:
        out = tmp_path / name
        shutil.copytree(folders["a"], out)
        _edit_config(out, **changes)
        return out

    refusals = {
        "DoRA": variant("dora", use_dora=True),
        "LoRA biases": variant("lora-bias", lora_bias=True),
        "bias 'all'": variant("bias", bias="all"),
        "modules_to_save": variant("save", modules_to_save=["lm_head"]),
        "per-module ranks": variant("ranks", rank_pattern={"q_proj": 2}),
        "exceeds --max-lora-rank 8": variant("rank", r=16),
        "peft_type 'IA3'": variant("ia3", peft_type="IA3"),
    }
    for why, path in refusals.items():
        with pytest.raises(ValueError, match=why):
            read_adapter(path, MAX_RANK)
    # malformed folders (a client may name any): each a ValueError, so a server's
    # /v1/load_lora_adapter answers 400 and serves on (they were a TypeError,
    # AttributeError or SafetensorError, which failed the engine)
    malformed = {"r must be an integer, got None": variant("null-rank", r=None),
                 "lora_alpha must be a number": variant("alpha", lora_alpha="8")}
    listed = variant("listed")
    (listed / "adapter_config.json").write_text("[]")
    malformed["adapter_config.json is not a JSON object"] = listed
    garbage = variant("garbage")
    (garbage / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    malformed["adapter_model.safetensors cannot be read"] = garbage
    for why, path in malformed.items():
        with pytest.raises(ValueError, match=why):
            read_adapter(path, MAX_RANK)
    pickled = tmp_path / "pickled"
    shutil.copytree(folders["a"], pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(ValueError, match="is a pickle"):
        read_adapter(pickled, MAX_RANK)
    hf = _hf("llama")
    with pytest.raises(ValueError, match="applies LoRA to q_proj"):  # embeddings, the head
        read_adapter(save_adapter(hf, tmp_path / "head", 1, r=4,
                                  target_modules=["q_proj", "lm_head"]), MAX_RANK)
    with pytest.raises(ValueError, match="not a LoRA A or B matrix"):
        read_adapter(save_adapter(hf, tmp_path / "embed", 1, r=4,
                                  target_modules=["embed_tokens"]), MAX_RANK)
    with pytest.raises(ValueError, match="--max-loras is 1"):
        lora_config(folders, max_loras=1)
    import transformers as tf

    # adapters of another model: one layer more, a narrower MLP
    for name, change, message in (("deep", {"num_hidden_layers": 3}, "no layer model.layers.2"),
                                  ("wide", {"intermediate_size": 96}, "shape")):
        other = tiny_hf_model(tf.LlamaConfig(**{**TINY, **change}), "LlamaForCausalLM")
        adapter = {name: save_adapter(other, tmp_path / name, 2, r=4, target_modules=ALL)}
        model, _ = load(folder)
        with pytest.raises(ValueError, match=f"'{name}'.*{message}"):
            attach_lora(model, lora_config(adapter, 1), LoraBatch(8, 1, MAX_RANK, torch.float32, CPU))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: GPU only")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lora_steps_replay_in_cuda_graphs_as_they_run_eagerly(checkpoints, dtype):
    """On a GPU, the runner with both adapters: a prefill, a mixed step and a pure decode
    whose sequences are under adapter a, adapter b and the base model replay captured
    graphs (the slots read from the static per-token buffer) equal to the eager forward,
    and the eager forward's last prompt rows equal PEFT's (float32; bf16 within its
    rounding)."""
    from dataclasses import replace

    from tpserve.model.plan import StepLimits
    from tpserve.model.runner import ModelRunner
    from tpserve.model.runner_config import RunnerConfig
    from tpserve.parallel.state import TPGroup

    folder, folders, want = checkpoints("llama")
    dev = torch.device("cuda", 0)
    cfg = RunnerConfig(model=folder, dtype=dtype, device="cuda", kernel_backend="triton",
                       kv_cache_memory=64 * 2**20, cuda_graph_max_tokens=128,
                       lora=lora_config(folders))
    limits = StepLimits(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256,
                        block_size=16)
    runners = [ModelRunner(cfg, limits, TPGroup(0, 1, dev, None)),
               ModelRunner(replace(cfg, enforce_eager=True), limits, TPGroup(0, 1, dev, None))]
    n = len(TOKENS)
    steps = [[SeqChunk(TOKENS, 0, [0, 1], True, lora_slot=0),
              SeqChunk(TOKENS, 0, [2, 3], True, lora_slot=1),
              SeqChunk(TOKENS, 0, [4, 5], True)],
             [SeqChunk([7], n, [0, 1], True, lora_slot=0),
              SeqChunk([7], n, [2, 3], True, lora_slot=1),
              SeqChunk([7], n, [4, 5], True)],
             [SeqChunk([9], n + 1, [0, 1], True, lora_slot=0),
              SeqChunk([9], n + 1, [2, 3], True, lora_slot=1),
              SeqChunk([9], n + 1, [4, 5], True)]]
    outs = [[], []]
    for runner, out in zip(runners, outs, strict=True):
        for chunks in steps:
            out.append(runner.execute(StepPlan.build(chunks, 16, runner.attn)).float().cpu())
    assert runners[0].graphs is not None and runners[0].graphs.graphs
    tol = 1e-4 if dtype == "float32" else 5e-2
    for got, eager in zip(*outs, strict=True):
        torch.testing.assert_close(got, eager, atol=tol, rtol=tol)
    for row, name in enumerate(("a", "b", None)):
        torch.testing.assert_close(outs[1][0][row], want[name][-1], atol=tol * 10,
                                   rtol=tol * 10)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_adapters_on_an_integer_base_equal_peft_on_its_dequantized_weights(checkpoints,
                                                                          tmp_path, fmt):
    """The same adapters on a GPTQ (act-order) / AWQ checkpoint of the Llama (its weights
    stay 4-bit codes; the adapters' products run beside the layer's own): PEFT's logits
    over the checkpoint's dequantized weights, at tp 1 and 2, mixed in one step with the
    base model."""
    import transformers as tf

    from tests.model.int_checkpoints import save_int_folders
    from tpserve.model.quant.wna16_method import Wna16Method

    base, folders, _ = checkpoints("llama")
    folder, twin = save_int_folders(Path(base), tmp_path / fmt, fmt, 4, 32,
                                    act_order=fmt == "gptq")
    hf = tf.AutoModelForCausalLM.from_pretrained(str(twin), dtype=torch.float32).eval()
    want = peft_logits(hf, folders, TOKENS)
    rows = [want["a"], want["b"], want[None]]
    method = Wna16Method(fmt, 4, 32, int(fmt == "gptq"), act_order=fmt == "gptq")
    for tp in (1, 2):
        for whole, stepped in run_ranks(_steps, tp, str(folder), folders, "allreduce",
                                        method):
            for got_whole, got_stepped, w in zip(whole, stepped, rows, strict=True):
                assert (got_whole - w).abs().max().item() < 1e-4, tp
                assert (got_stepped - w).abs().max().item() < 1e-4, tp
    model, _, _ = with_lora(str(folder), folders, quant_method=method)
    qkv = lora_layers(model)["model.layers.0.self_attn.qkv_proj"].lora
    assert qkv.w_ext is None and qkv.a.dtype == torch.float32  # beside the integer weight


def test_adapters_on_an_fp8_base_equal_peft_on_its_dequantized_weights(checkpoints):
    """The same adapters over ``--quantization fp8`` (e4m3 weights quantized at load, every
    step weight-only): PEFT's logits over the fp8 model's dequantized weights, at tp 1 and
    2 (every rank picks the tp 1 scales). With W8A8 steps (activations quantized per token
    by the layer, not by the norm before it, while adapters are attached) the base model's
    rows of a mixed step are those of the fp8 model without LoRA."""
    import transformers as tf

    from tests.model.util import copy_dequantized_layer
    from tpserve.model.quant.fp8 import Fp8LinearMethod

    folder, folders, _ = checkpoints("llama")
    weight_only = Fp8LinearMethod(weight_only_max_tokens=512)
    ours, _ = load(folder, quant_method=weight_only)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for mine, theirs in zip(ours.model.layers, hf.model.layers, strict=True):
            copy_dequantized_layer(mine, theirs, ours.cfg)
    want = peft_logits(hf, folders, TOKENS)
    rows = [want["a"], want["b"], want[None]]
    for tp in (1, 2):
        for whole, stepped in run_ranks(_steps, tp, folder, folders, "allreduce",
                                        weight_only):
            for got_whole, got_stepped, w in zip(whole, stepped, rows, strict=True):
                assert (got_whole - w).abs().max().item() < 1e-4, tp
                assert (got_stepped - w).abs().max().item() < 1e-4, tp
    w8a8 = Fp8LinearMethod(weight_only_max_tokens=0)
    plain, comm = load(folder, quant_method=w8a8)
    chunk = [SeqChunk(TOKENS, 0, [0, 1], True)]
    base = run_step(plain, None, new_pool(plain, comm), chunk)
    model, _, batch = with_lora(folder, folders, quant_method=w8a8)
    mixed = run_step(model, batch, new_pool(model, comm), [
        SeqChunk(TOKENS, 0, [0, 1], True), SeqChunk(TOKENS, 0, [2, 3], True, lora_slot=0)])
    torch.testing.assert_close(mixed[:len(TOKENS)], base, atol=1e-4, rtol=1e-4)
    assert (mixed[len(TOKENS):] - base).abs().max().item() > 0.1  # adapter a applies


def test_adapters_on_a_gguf_base_equal_peft(checkpoints, tmp_path):
    """The same adapters on the Llama's weights as a llama.cpp GGUF file (q/k rows
    permuted by the converter, unpermuted at load) give PEFT's logits at tp 1 and 2."""
    from tests.model.util import save_gguf_file

    _, folders, want = checkpoints("llama")
    path = str(save_gguf_file(_hf("llama"), tmp_path / "llama.gguf", "llama"))
    rows = [want["a"], want["b"], want[None]]
    for tp in (1, 2):
        for whole, stepped in run_ranks(_steps, tp, path, folders, "allreduce"):
            for got_whole, got_stepped, w in zip(whole, stepped, rows, strict=True):
                assert (got_whole - w).abs().max().item() < 1e-4, tp
                assert (got_stepped - w).abs().max().item() < 1e-4, tp
