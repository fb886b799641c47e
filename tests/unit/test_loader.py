"""Checkpoint loading: zero-copy for unquantised GGUF tensors, clear errors for bad files."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from gemel.loader import gguf_loader, safetensors_loader, sources


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    return sources.resolve("smollm2-135m-instruct")


def test_gguf_metadata_to_llama_config(smollm2_path):
    reader = gguf_loader.open_gguf(smollm2_path)
    cfg = gguf_loader.arch_config(reader, smollm2_path)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0


def test_unquantised_gguf_tensors_are_not_copied(smollm2_path):
    from gemel.models.weights import WeightSource

    reader = gguf_loader.open_gguf(smollm2_path)
    cfg = gguf_loader.arch_config(reader, smollm2_path)
    base, size = reader.data.ctypes.data, reader.data.nbytes
    weights = WeightSource(gguf_loader.tensor_factories(reader, cfg), torch.float32, torch.device("cpu"), smollm2_path)
    norm = weights.get("model.layers.0.input_layernorm.weight")  # F32 in the file
    assert base <= norm.data_ptr() < base + size, "F32 tensor was copied out of the memory map"
    quantised = weights.get("model.layers.0.mlp.down_proj.weight")  # Q4_1: dequantised, so a new buffer
    assert not base <= quantised.data_ptr() < base + size
    assert quantised.shape == (576, 1536)


def test_truncated_gguf_names_file_and_tensor(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(os.path.getsize(smollm2_path) // 2))
    with pytest.raises(gguf_loader.GGUFLoadError) as err:
        gguf_loader.open_gguf(str(cut))
    assert str(cut) in str(err.value) and "tensor" in str(err.value) and "truncated" in str(err.value)


def test_garbage_gguf_names_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(gguf_loader.GGUFLoadError, match="bad.gguf"):
        gguf_loader.open_gguf(str(bad))


def _metadata_file(path: str) -> None:
    """A GGUF file with a metadata value of each kind the reader handles: scalars, strings
    (empty, multi-byte), arrays of numbers, strings, bools, an empty and a nested array."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("test.count", 7)
    writer.add_float32("test.eps", 1e-5)
    writer.add_string("test.name", "ünï 東京")
    writer.add_array("test.words", ["", "a", "▁the", "ünï", "東京", "x" * 300])
    writer.add_array("test.floats", [0.5, -1.25, 3.0])
    writer.add_array("test.ints", list(range(-3, 1000)))
    writer.add_array("test.flags", [True, False, True])
    writer.add_array("test.empty", [])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_tensor("blk.0.ffn_down.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_metadata_reads_as_the_gguf_package_reads_it(tmp_path, smollm2_path):
    import gguf
    import numpy as np

    made = str(tmp_path / "meta.gguf")
    _metadata_file(made)
    for path in (made, smollm2_path):
        ours, stock = gguf_loader.open_gguf(path), gguf.GGUFReader(path)
        assert list(ours.fields) == list(stock.fields)
        for key, field in stock.fields.items():
            assert ours.fields[key].types == field.types, key
            assert ours.fields[key].contents() == field.contents(), key
        assert [(t.name, t.data_offset) for t in ours.tensors] == [(t.name, t.data_offset) for t in stock.tensors]
        assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, stock.tensors))
    reader = gguf_loader.open_gguf(made)
    assert gguf_loader.field(reader, "test.words") == ["", "a", "▁the", "ünï", "東京", "x" * 300]
    assert gguf_loader.field(reader, "test.ints") == list(range(-3, 1000))
    assert gguf_loader.field(reader, "test.flags") == [True, False, True]


def test_string_array_cut_short_names_file(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(200_000))  # inside tokenizer.ggml.tokens
    with pytest.raises(gguf_loader.GGUFLoadError, match="cut.gguf.*past the end"):
        gguf_loader.open_gguf(str(cut))


def test_missing_source_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        sources.resolve("no-such-model")


def test_truncated_safetensors_names_file_and_tensor(tmp_path, tiny_llama_dir):
    d = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, d)
    st = d / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) - 1000])
    cfg = safetensors_loader.arch_config(str(d))
    with pytest.raises(safetensors_loader.SafetensorsLoadError) as err:
        safetensors_loader.tensor_factories(str(d), cfg)
    assert "model.safetensors" in str(err.value) and "truncated" in str(err.value) and "tensor" in str(err.value)


def test_unsupported_architecture_is_rejected(tmp_path, tiny_llama_dir):
    d = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(safetensors_loader.SafetensorsLoadError, match="MambaForCausalLM"):
        safetensors_loader.arch_config(str(d))


def test_q4_groups_reproduce_the_files_weights(smollm2_path):
    """The 4-bit groups read for the packed kernel dequantise to exactly the file's weights,
    including the q/k rows that llama.cpp stores permuted."""
    reader = gguf_loader.open_gguf(smollm2_path)
    cfg = gguf_loader.arch_config(reader, smollm2_path)
    dense = gguf_loader.tensor_factories(reader, cfg)
    groups = gguf_loader.int4_group_factories(reader, cfg)
    assert len(groups) == 7 * cfg.num_layers  # every Q4_1 projection; the Q8_0 embedding is not 4-bit
    assert "model.embed_tokens.weight" not in groups
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight"):
        g = groups[name]()
        assert g.q.dtype == torch.uint8 and int(g.q.max()) <= 15
        assert torch.equal(g.dequantize(), dense[name]().float())


def test_q8_groups_reproduce_the_files_embedding(smollm2_path):
    """SmolLM2 stores its embedding (also the LM head) as Q8_0; the int8 groups read for the
    C++ kernel dequantise to exactly the file's weights."""
    reader = gguf_loader.open_gguf(smollm2_path)
    cfg = gguf_loader.arch_config(reader, smollm2_path)
    groups = gguf_loader.int8_group_factories(reader, cfg)
    assert list(groups) == ["model.embed_tokens.weight"]
    g = groups["model.embed_tokens.weight"]()
    assert g.q.dtype == torch.int8 and g.q.shape == (cfg.vocab_size, cfg.hidden_size)
    assert torch.equal(g.dequantize(), gguf_loader.tensor_factories(reader, cfg)["model.embed_tokens.weight"]().float())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_group_layouts_match_gguf_dequantisation(tmp_path, qtype):
    import gguf
    import numpy as np

    from gemel.models.config import ModelArchConfig

    kind = getattr(gguf.GGMLQuantizationType, qtype)
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    path = str(tmp_path / "q4.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_down.weight", gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf_loader.open_gguf(path)
    cfg = ModelArchConfig(architecture="llama", vocab_size=8, hidden_size=96, intermediate_size=48, num_layers=1,
                          num_heads=1, num_kv_heads=1, head_dim=96, rms_norm_eps=1e-6, rope_theta=1e4,
                          max_position_embeddings=64)
    factories = gguf_loader.int8_group_factories if qtype == "Q8_0" else gguf_loader.int4_group_factories
    g = factories(reader, cfg)["model.layers.0.mlp.down_proj.weight"]()
    expected = gguf.quants.dequantize(reader.tensors[0].data, kind).reshape(48, 96)
    torch.testing.assert_close(g.dequantize(), torch.from_numpy(expected), atol=1e-6, rtol=1e-6)
