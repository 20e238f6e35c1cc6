"""``--overlap-attention``: the flag, and how it reaches the attention back-end. The kernels'
side of it (a padding decode slot writes nothing; two streams give one stream's result, in
CUDA graphs too) is in ``test_triton_kernels.py`` and ``test_cuda_graph_path.py``."""

from __future__ import annotations

import torch

from tpserve.cli import build_parser
from tpserve.model.attention.backend import select_attention
from tpserve.model.runner import ModelRunner
from tpserve.model.runner_config import RunnerConfig
from tpserve.server.config import config_from_args


def test_the_flag_resolves_on_by_default():
    parser, _ = build_parser()
    dummy = ["serve", "smollm2-135m", "--load-format", "dummy"]  # no embedded model needed
    assert config_from_args(parser.parse_args(dummy)).runner.overlap_attention is True
    off = config_from_args(parser.parse_args([*dummy, "--no-overlap-attention"]))
    assert off.runner.overlap_attention is False
    assert RunnerConfig().overlap_attention is False  # a bare (CPU) runner's default


def test_the_backends_take_it_and_only_cuda_gets_a_side_stream():
    triton_on = select_attention("triton", torch.bfloat16, overlap=True)
    assert triton_on.overlap is True
    assert triton_on.side_stream(torch.device("cpu")) is None  # no streams off CUDA
    assert select_attention("triton", torch.bfloat16).side_stream(torch.device("cpu")) is None
    assert select_attention("triton", torch.bfloat16, overlap=False).overlap is False
    assert select_attention("torch", torch.float32, overlap=True).overlap is True  # ignored


def test_the_runner_hands_it_to_its_backend(tiny_llama):
    from tpserve.model.plan import StepLimits
    from tpserve.parallel.state import TPGroup

    limits = StepLimits(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                        block_size=16)
    for overlap in (False, True):
        cfg = RunnerConfig(model=str(tiny_llama), overlap_attention=overlap,
                           kv_cache_memory=2**20)
        runner = ModelRunner(cfg, limits, TPGroup(0, 1, torch.device("cpu"), None))
        assert runner.attn.overlap is overlap
