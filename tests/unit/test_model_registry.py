"""The model registry: every family is found from each name a checkpoint may give it, and a name
no family serves is an error that lists the supported ones."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gemel.loader import gguf_loader, model_loader, safetensors_loader
from gemel.models import registry


@pytest.mark.parametrize("fam", registry.families(), ids=lambda f: f.name)
def test_every_family_resolves_from_its_names(fam):
    assert registry.family(fam.name) is fam
    assert registry.family_for_gguf(fam.gguf_architecture) is fam
    assert fam.hf_architectures
    for hf in fam.hf_architectures:
        assert registry.family_for_hf([hf]) is fam
        assert registry.family_for_hf(["SomethingElseForCausalLM", hf]) is fam  # first one served wins
    assert isinstance(fam.model_class(), type)


def test_names_are_unique_across_families():
    fams = registry.families()
    assert len({f.name for f in fams}) == len(fams)
    assert len({f.gguf_architecture for f in fams}) == len(fams)
    hf = [a for f in fams for a in f.hf_architectures]
    assert len(set(hf)) == len(hf)
    assert registry.supported_hf_architectures() == sorted(hf)


def test_model_classes():
    from gemel.models.gemma3 import Gemma3ForCausalLM
    from gemel.models.llama import LlamaForCausalLM

    assert model_loader.model_class("llama") is LlamaForCausalLM
    assert model_loader.model_class("qwen2") is LlamaForCausalLM  # the Llama decoder with q/k/v biases
    assert model_loader.model_class("gemma3") is Gemma3ForCausalLM
    with pytest.raises(ValueError, match="'mamba' is not supported.*llama"):
        model_loader.model_class("mamba")


def test_unknown_names_are_clear_errors():
    with pytest.raises(registry.UnsupportedArchitecture, match=r"'mamba' is not supported \(supported: .*'qwen2'"):
        registry.family("mamba")
    with pytest.raises(registry.UnsupportedArchitecture, match=r"'mamba' is not supported \(supported: .*'gemma3'"):
        registry.family_for_gguf("mamba")
    with pytest.raises(registry.UnsupportedArchitecture, match=r"\['MambaForCausalLM'\] not supported.*Qwen2ForCausalLM"):
        registry.family_for_hf(["MambaForCausalLM"])
    with pytest.raises(registry.UnsupportedArchitecture, match=r"\[\] not supported"):
        registry.family_for_hf([])


def test_unknown_gguf_architecture_names_the_file(tmp_path):
    import gguf
    import numpy as np

    path = str(tmp_path / "mamba.gguf")
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(gguf_loader.GGUFLoadError, match=r"mamba\.gguf: architecture 'mamba' is not supported.*'llama'"):
        gguf_loader.arch_config(gguf_loader.open_gguf(path), path)


def test_family_defaults_reach_the_config(tiny_qwen2_dir, tiny_gemma3_dir):
    """config.json leaves out what the family implies: Qwen2's q/k/v biases; Gemma 3's tied
    embeddings and norm weights stored without their 1."""
    qwen2 = safetensors_loader.arch_config(tiny_qwen2_dir)
    assert (qwen2.architecture, qwen2.attention_bias, qwen2.tie_word_embeddings, qwen2.layer_types) == (
        "qwen2", True, False, [])
    gemma3 = safetensors_loader.arch_config(tiny_gemma3_dir)
    assert gemma3.architecture == "gemma3" and gemma3.sliding_window == 8
    assert gemma3.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    stored = safetensors_loader.tensor_factories(tiny_gemma3_dir, gemma3)["model.norm.weight"]()
    from safetensors.torch import load_file

    raw = load_file(f"{tiny_gemma3_dir}/model.safetensors")["model.norm.weight"]
    assert float((stored - (raw.float() + 1.0)).abs().max()) == 0.0


def test_registry_imports_no_model_module():
    """The API process reads configs through the registry without loading torch or a model."""
    code = (
        "import sys, gemel.models.registry as r; r.family_for_hf(['Gemma3ForCausalLM']);"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('gemel.models.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['gemel.models.config', 'gemel.models.registry']"
