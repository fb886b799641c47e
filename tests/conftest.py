"""Shared fixtures: tiny random-weight Llama, Gemma 3 and Qwen2 checkpoints made with transformers.

Each is a real Hugging Face directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), so gemel loads it through the same code path as a downloaded
checkpoint, and transformers gives the reference outputs on the very same weights.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Continuous batching lets requests join and leave every step.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "Hello, world! How are you today? I am fine, thanks.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 320

sys.path.insert(0, os.path.dirname(__file__))  # tests/parity.py helpers


def _write_tokenizer(directory: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            f,
        )


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Larger-than-init weights so logits are decisive (few near-ties) yet finite."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms: scatter around their neutral value
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)


def make_tiny_llama(directory: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    _randomise(model, 1)
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    return directory


def make_tiny_gemma3(directory: str) -> str:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,  # far shorter than the test prompts, so the window matters
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg)
    _randomise(model, 2)
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    return directory


def make_tiny_qwen2(directory: str) -> str:
    """Qwen2: the Llama decoder with q/k/v biases (config.json does not say so: the loader
    must know it from the architecture), untied LM head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    _randomise(model, 3)
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> str:
    return make_tiny_gemma3(str(tmp_path_factory.mktemp("tiny-gemma3")))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return make_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="session", params=["llama", "gemma3"])
def tiny_model_dir(request, tiny_llama_dir, tiny_gemma3_dir) -> str:
    return {"llama": tiny_llama_dir, "gemma3": tiny_gemma3_dir}[request.param]


# -- a real Redis ------------------------------------------------------------------------------
def start_redis(directory: str) -> tuple[str, object]:
    """A private ``redis-server`` on a free loopback port (no persistence): (its URL, process)."""
    import shutil
    import socket
    import subprocess
    import time

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (scripts/install.sh installs it with apt)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", directory],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return f"redis://127.0.0.1:{port}/0", proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    url, proc = start_redis(str(tmp_path_factory.mktemp("redis")))
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def redis_factory():
    """``start_redis`` for tests that need a Redis of their own (e.g. to stop it)."""
    return start_redis
