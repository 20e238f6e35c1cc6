"""Our GGUF reader gives what ``gguf.GGUFReader`` gives: every metadata value and every
tensor (name, type, shape, bytes), on the embedded model and on a file written here."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tpserve.model.loader.checkpoint import embedded_model_path
from tpserve.model.loader.gguf_reader import GGUFFile, LazyArray


def assert_same_as_gguf(path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = {k for k in theirs.fields if not k.startswith("GGUF.")}  # its own pseudo-fields
    assert set(ours.fields) == keys
    for key in keys:
        assert ours.get(key) == theirs.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type
        assert a.shape == tuple(b.shape.tolist())
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name
    return ours


def test_the_embedded_model_reads_the_same():
    f = assert_same_as_gguf(embedded_model_path())
    tokens = f.fields["tokenizer.ggml.tokens"]
    assert isinstance(tokens, LazyArray) and len(tokens) == 49152


def test_a_written_file_reads_the_same(tmp_path):
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_int32("t.negative", -7)
    w.add_float32("t.eps", 1e-5)
    w.add_float64("t.f64", 0.125)
    w.add_bool("t.flag", True)
    w.add_string("t.text", "héllo wörld")
    w.add_array("t.strings", ["a", "", "ünï", "x" * 300])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 4, 8)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = assert_same_as_gguf(path)
    assert f.get("t.strings") == ["a", "", "ünï", "x" * 300]
    assert f.get("t.negative") == -7 and f.get("missing", 5) == 5


def test_not_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(path)
