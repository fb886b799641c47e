"""Tokenizer of one model: text <-> token ids, special tokens, chat template, streaming detokenization.

Built on the `tokenizers` library only (no transformers at runtime). Two sources are supported:

* a GGUF file, whose metadata holds the vocabulary under llama.cpp's keys. We rebuild the same
  `tokenizers` pipeline that Hugging Face would use for that model (byte-level BPE for
  ``tokenizer.ggml.model == "gpt2"``, SentencePiece-style BPE with byte fallback for ``"llama"``);
* a Hugging Face model directory with ``tokenizer.json``.

Chat templates are rendered with a sandboxed jinja2 environment set up like transformers' one, so
prompts are byte-identical to what ``AutoTokenizer.apply_chat_template`` produces.
"""

from __future__ import annotations

import array
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

if TYPE_CHECKING:
    import gguf

__all__ = ["Tokenizer", "IncrementalDetokenizer", "FALLBACK_CHAT_TEMPLATE"]

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType); spelled out so this module does not need gguf at import.
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6

# Tokens that end an assistant turn in common chat formats; generation must stop on them too.
_TURN_END_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>")

# Bump when the way a tokenizer is built from GGUF changes, so stale cache files are not reused.
_BUILD_VERSION = "gemel-tokenizer-v1"

# Used when a model (e.g. a base model) has no chat template: one "role: content" line per message,
# then an open "assistant: " turn. Deliberately plain so that base models can continue it.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# Pre-tokenizer split regexes of byte-level BPE vocabularies, keyed by llama.cpp's
# `tokenizer.ggml.pre`. They are the ones in llama.cpp (llama-vocab.cpp) and in the models'
# tokenizer.json files on the Hugging Face Hub.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE: dict[str, str] = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Llama-3 style vocabularies look a whole pre-token up before merging (llama.cpp `ignore_merges`).
_IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe"})


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids, special tokens and chat template of one model."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
        vocab_size: int | None = None,
        name: str = "",
    ) -> None:
        """Wrap a built `tokenizers.Tokenizer`; use `from_gguf` / `from_pretrained_dir` instead."""
        self._backend = backend
        self.vocab_size: int = vocab_size if vocab_size is not None else backend.get_vocab_size(True)
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))  # dedup, keep order
        self.add_bos: bool = add_bos
        self.chat_template: str | None = chat_template
        self.name = name
        self._compiled_template: jinja2.Template | None = None

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, add_bos={self.add_bos}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )

    @property
    def backend(self) -> _Backend:
        """The underlying `tokenizers.Tokenizer` (e.g. for batch encoding)."""
        return self._backend

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_gguf(
        cls, reader: gguf.GGUFReader, path: str, *, cache_dir: str | None = None
    ) -> Tokenizer:
        """Build the tokenizer described by a GGUF file's `tokenizer.*` metadata.

        `cache_dir` (default ``~/.cache/gemel/tokenizers``) stores tokenizers whose BPE merges had
        to be derived from the vocabulary (SentencePiece files list none), which is the slow part.
        """
        meta = _GGUFMeta(reader, path)
        tokens = meta.get("tokenizer.ggml.tokens")
        model_type = meta.get("tokenizer.ggml.model")
        if not tokens or model_type is None:
            raise ValueError(
                f"{path}: the GGUF file has no tokenizer metadata "
                "(tokenizer.ggml.model / tokenizer.ggml.tokens); cannot build a tokenizer"
            )
        tokens = list(tokens)
        token_types = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))

        embedded = meta.get("tokenizer.huggingface.json")
        if embedded:  # the converter stored the original tokenizer.json: nothing to rebuild
            backend = _Backend.from_str(embedded)
        elif model_type == "gpt2":
            merges = meta.get("tokenizer.ggml.merges")
            if not merges:
                raise ValueError(f"{path}: byte-level BPE (gpt2) tokenizer without tokenizer.ggml.merges")
            backend = _build_byte_level_bpe(
                tokens, token_types, list(merges), meta.get("tokenizer.ggml.pre") or "default"
            )
        elif model_type == "llama":
            scores = meta.get("tokenizer.ggml.scores")
            merges = meta.get("tokenizer.ggml.merges")
            add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            unk_id = meta.get("tokenizer.ggml.unknown_token_id")
            backend = _load_sentencepiece_bpe(
                tokens,
                token_types,
                list(scores) if scores is not None else None,
                list(merges) if merges else None,
                add_space_prefix=add_space_prefix,
                unk_token=tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None,
                cache_dir=_default_cache_dir() if cache_dir is None else cache_dir,
            )
        else:
            raise ValueError(
                f"{path}: unsupported GGUF tokenizer model {model_type!r} "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
            )

        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = [eos_id] if eos_id is not None else []
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if (extra := meta.get(key)) is not None:
                eos_ids.append(extra)
        vocab_index = {tok: i for i, tok in enumerate(tokens)}
        eos_ids += [vocab_index[t] for t in _TURN_END_TOKENS if t in vocab_index]
        # llama.cpp's defaults when the flag is absent: SentencePiece adds BOS, byte-level BPE does not.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", model_type == "llama"))
        return cls(
            backend,
            bos_token_id=int(bos_id) if bos_id is not None else None,
            eos_token_ids=[int(i) for i in eos_ids],
            add_bos=add_bos and bos_id is not None,
            chat_template=meta.get("tokenizer.chat_template") or None,
            vocab_size=len(tokens),
            name=os.path.basename(path),
        )

    @classmethod
    def from_pretrained_dir(cls, path: str) -> Tokenizer:
        """Load a Hugging Face model directory (tokenizer.json + tokenizer_config.json, optional
        generation_config.json and chat_template.jinja)."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{path}: no tokenizer.json in this directory; cannot build a tokenizer")
        backend = _Backend.from_file(str(tokenizer_file))
        config = _read_json(root / "tokenizer_config.json")
        gen_config = _read_json(root / "generation_config.json")

        def token_id(value: Any) -> int | None:
            text = value.get("content") if isinstance(value, Mapping) else value
            return backend.token_to_id(text) if isinstance(text, str) else None

        bos_id = token_id(config.get("bos_token"))
        if bos_id is None and isinstance(gen_config.get("bos_token_id"), int):
            bos_id = gen_config["bos_token_id"]

        eos_ids: list[int] = []
        if (eos := token_id(config.get("eos_token"))) is not None:
            eos_ids.append(eos)
        gen_eos = gen_config.get("eos_token_id")
        eos_ids += gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []

        template_file = root / "chat_template.jinja"
        chat_template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else _pick_chat_template(config.get("chat_template"))
        )
        # Turn-end markers the template writes (e.g. <|im_end|>) also end generation.
        for text in _TURN_END_TOKENS:
            if chat_template and text in chat_template and (i := backend.token_to_id(text)) is not None:
                eos_ids.append(i)

        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:  # no flag: BOS comes from tokenizer.json's post-processor, if at all
            ids = backend.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and ids[:1] == [bos_id]
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos=add_bos and bos_id is not None,
            chat_template=chat_template,
            name=root.name,
        )

    # ---------------------------------------------------------------- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. "<|im_start|>") map to their
        ids. BOS is prepended when the model wants one and `add_special_tokens` is set."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; control tokens (BOS, <|im_end|>, ...) are dropped by default."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        """The vocabulary piece of id `i` as stored (e.g. "Ġhello" or "▁hello")."""
        token = self._backend.id_to_token(i)
        if token is None:
            raise IndexError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return token

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary piece, or None."""
        return self._backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        """Text of the BOS token (what a chat template writes as `bos_token`)."""
        return self._token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """Text of the primary EOS token."""
        return self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None)

    def _token_text(self, token_id: int | None) -> str | None:
        if token_id is None:
            return None
        return self._backend.decode([token_id], skip_special_tokens=False)

    # ---------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_vars: Any,
    ) -> str:
        """Render a conversation to the prompt text the model was trained on.

        Uses the model's chat template, or `FALLBACK_CHAT_TEMPLATE` when it has none. Message
        content may be a string or a list of ``{"type": "text", "text": ...}`` parts (their texts
        are concatenated). Extra keyword arguments become template variables (e.g.
        ``enable_thinking``), like in transformers.
        """
        if self._compiled_template is None:
            self._compiled_template = _jinja_env().from_string(self.chat_template or FALLBACK_CHAT_TEMPLATE)
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **template_vars,
        }
        return self._compiled_template.render(
            messages=[_plain_message(m) for m in messages],
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_vars: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation.

        Templates usually write BOS themselves; BOS is only added here when the model wants one
        and the rendered text does not already start with it (so it is never doubled). For
        templates without BOS on models with add_bos=False this equals transformers'
        ``apply_chat_template(tokenize=True)``.
        """
        return self.encode_rendered(self.apply_chat_template(messages, add_generation_prompt, tools, **template_vars))

    def encode_rendered(self, prompt: str) -> list[int]:
        """Token ids of a conversation ``apply_chat_template`` rendered already (so a caller
        that needs both the text and the ids renders the template once)."""
        bos = self.bos_token
        starts_with_bos = bool(bos) and prompt.startswith(bos)
        return self.encode(prompt, add_special_tokens=not starts_with_bos)


# --------------------------------------------------------------------------------------------
# Streaming detokenization
# --------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    Decoding tokens one by one is wrong in two ways: a character may span several tokens (byte-level
    BPE pieces, SentencePiece byte-fallback tokens), and whether a piece's leading space shows
    depends on its left neighbour for SentencePiece decoders. So, like vLLM, we decode a small
    window that starts one emitted chunk back (prefix_offset..read_offset is text already emitted)
    and emit only what the new tokens added. While the window's text ends in U+FFFD the last
    character is incomplete and the delta is held back. The concatenation of all deltas (plus
    `flush()` at the end of a stream) equals ``tokenizer.decode(all_ids)``.
    """

    # Prompt tokens kept as left context: enough for the first generated token's spacing.
    PROMPT_CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self.PROMPT_CONTEXT :]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text: str = ""

    def add(self, new_ids: Iterable[int]) -> str:
        """Append generated ids; return the text they complete (may be "" while held back)."""
        self._ids.extend(new_ids)
        delta = self._pending_text()
        if not delta or delta.endswith("\ufffd"):
            return ""
        return self._emit(delta)

    def flush(self) -> str:
        """Emit whatever is held back (e.g. an invalid UTF-8 tail) at the end of a stream."""
        return self._emit(self._pending_text())

    def _pending_text(self) -> str:
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip)
        window = decode(self._ids[self._prefix_offset :], skip)
        return window[len(prefix) :] if len(window) > len(prefix) else ""

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta


# --------------------------------------------------------------------------------------------
# GGUF -> tokenizers pipeline
# --------------------------------------------------------------------------------------------


class _GGUFMeta:
    """Read-only view of a GGUF reader's metadata fields, with clear errors naming the file."""

    def __init__(self, reader: gguf.GGUFReader, path: str) -> None:
        self._fields = reader.fields
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as exc:  # a malformed field should say which file and key
            raise ValueError(f"{self._path}: cannot read GGUF metadata {key!r}: {exc}") from exc


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """Pre-tokenizer for llama.cpp's `tokenizer.ggml.pre`, and whether BPE should ignore merges."""
    if pre == "smollm":  # SmolLM/SmolLM2: every digit alone, then GPT-2 splitting
        return (
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            ),
            False,
        )
    split = _SPLIT_BY_PRE.get(pre)
    if split is None:
        # "default", "gpt2" and pre types we do not know: GPT-2's own regex (built into ByteLevel).
        # Unknown types may split slightly differently from the reference tokenizer.
        if pre not in ("default", "gpt2"):
            logger.warning("unknown GGUF tokenizer.ggml.pre %r: using the GPT-2 split regex", pre)
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    return (
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
        pre in _IGNORE_MERGES_PRE,
    )


def _build_byte_level_bpe(
    tokens: list[str], token_types: list[int], merges: list[str], pre: str
) -> _Backend:
    """GPT-2 style byte-level BPE from a GGUF vocabulary and merge list."""
    alphabet = set(_bytes_to_unicode().values())
    spelling = _bytes_to_unicode()

    def byte_level(token: str) -> str:
        # Some converters store raw text; the BPE vocabulary must be in the byte alphabet.
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {byte_level(tok): i for i, tok in enumerate(tokens)}
    pair_list = [cast(tuple[str, str], tuple(m.split(" ", 1))) for m in merges]
    pre_tokenizer, ignore_merges = _byte_level_pre_tokenizer(pre)
    backend = _Backend(
        models.BPE(
            vocab=vocab,
            merges=pair_list,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=ignore_merges,
        )
    )
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    # Control tokens spelled outside the byte alphabet are llama.cpp mislabels; keep them out.
    _add_gguf_special_tokens(backend, tokens, token_types, keep=lambda tok: set(tok) <= alphabet)
    return backend


def _add_gguf_special_tokens(
    backend: _Backend,
    tokens: list[str],
    token_types: list[int],
    keep: Callable[[str], bool] | None = None,
) -> None:
    """Make control tokens (type 3) special and user-defined tokens (type 4) plain added tokens,
    so both are matched whole in text instead of being cut into pieces.

    User-defined tokens are not special: Gemma's "\\n\\n" or "<table>" are ordinary text that
    `decode(skip_special_tokens=True)` must keep.
    """
    vocab = backend.get_vocab(with_added_tokens=False)
    control, user_defined = [], []
    for tok, kind in zip(tokens, token_types):
        if tok not in vocab or (keep is not None and not keep(tok)):
            continue
        if kind == _CONTROL:
            control.append(AddedToken(tok, special=True, normalized=False))
        elif kind == _USER_DEFINED:
            user_defined.append(AddedToken(tok, special=False, normalized=False))
    if control:
        backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)


def _load_sentencepiece_bpe(
    tokens: list[str],
    token_types: list[int],
    scores: list[float] | None,
    merges: list[str] | None,
    *,
    add_space_prefix: bool,
    unk_token: str | None,
    cache_dir: str,
) -> _Backend:
    """SentencePiece BPE tokenizer, from the on-disk cache when its merges had to be derived."""
    if merges:  # some converters store merges for SentencePiece vocabularies too
        pairs = [cast(tuple[str, str], tuple(m.split(" ", 1))) for m in merges]
        return _build_sentencepiece_bpe(tokens, token_types, pairs, add_space_prefix, unk_token)
    digest = hashlib.sha256(_BUILD_VERSION.encode())
    digest.update(f"{add_space_prefix}|{unk_token}|".encode())
    digest.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    digest.update(array.array("d", scores or []).tobytes())
    digest.update(array.array("q", token_types).tobytes())
    cache_file = Path(cache_dir) / f"{digest.hexdigest()}.json" if cache_dir else None
    if cache_file is not None and cache_file.is_file():
        try:
            return _Backend.from_file(str(cache_file))
        except Exception:  # corrupt or from an incompatible tokenizers version: rebuild
            logger.warning("ignoring unreadable tokenizer cache %s", cache_file)
    backend = _build_sentencepiece_bpe(tokens, token_types, None, add_space_prefix, unk_token)
    if cache_file is not None:
        _write_atomically(cache_file, backend.to_str())
    return backend


def _respell_spaces(tokens: list[str]) -> list[str]:
    """Gemma GGUFs store whitespace pieces with real spaces ("  "), but text reaches the model with
    spaces turned into "▁", so those pieces must be spelled "▁▁" to ever match (as in transformers)."""
    present = set(tokens)
    out = []
    for tok in tokens:
        if " " in tok and not tok.strip():
            respelled = tok.replace(" ", "\u2581")
            if respelled not in present:
                tok = respelled
        out.append(tok)
    return out


def _derive_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary (the GGUF stores none).

    Every split of a piece into two pieces that are both in the vocabulary is a merge; merges are
    ranked by the merged piece, best first, and for one piece the longer left part first (like
    transformers' SentencePieceExtractor / `generate_merges`). The rank of a piece is its position
    in the file: llama.cpp writes pieces in the SentencePiece model's order, which is descending
    score for normal pieces, while user-defined pieces (Gemma's "\\n\\n", "▁▁") carry a placeholder
    score of -1000 that would misplace them. For Gemma this matches transformers exactly.
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked: list[tuple[int, int, str, str]] = []
    for rank, piece in enumerate(tokens):
        for cut in range(len(piece) - 1, 0, -1):  # longer left part first
            left = piece[:cut]
            if left in vocab:
                right = piece[cut:]
                if right in vocab:
                    ranked.append((rank, len(piece) - cut, left, right))
    ranked.sort(key=lambda m: (m[0], m[1]))
    return [(left, right) for _, _, left, right in ranked]


def _build_sentencepiece_bpe(
    tokens: list[str],
    token_types: list[int],
    merges: list[tuple[str, str]] | None,
    add_space_prefix: bool,
    unk_token: str | None,
) -> _Backend:
    """SentencePiece-style BPE: spaces become "▁", unknown bytes fall back to <0xNN> tokens.
    `merges=None` derives them from the vocabulary."""
    spelled = _respell_spaces(tokens)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(spelled):
        vocab.setdefault(tok, i)
    backend = _Backend(
        models.BPE(
            vocab=vocab,
            merges=merges if merges is not None else _derive_merges(spelled),
            unk_token=unk_token if unk_token in vocab else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps: list[decoders.Decoder] = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        # Llama/Mistral style: a "▁" is prepended to the text (only before its first segment) and
        # the decoder strips that one leading space again.
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        # Gemma style: spaces are "▁", no dummy prefix.
        backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence(steps)
    # With the file's spelling: a respelled "  " is reached through merges, not as an added token.
    _add_gguf_special_tokens(backend, tokens, token_types)
    return backend


# --------------------------------------------------------------------------------------------
# Chat template rendering (mirrors transformers' sandboxed environment)
# --------------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accepts HF's ``{% generation %}...{% endgeneration %}`` (marks assistant text for training
    masks) and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON (as in transformers).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """A sandboxed environment configured like transformers' chat template renderer."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Copy of a message as templates expect it: no None-valued keys (templates test
    ``is defined``), and list-of-parts content flattened to one string."""
    out = {k: v for k, v in message.items() if v is not None}
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                texts.append(str(part.get("text", "")))
            else:
                raise ValueError(f"unsupported message content part (only text is supported): {part!r}")
        out["content"] = "".join(texts)
    return out


def _pick_chat_template(value: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default") or next(iter(named.values()), None)
    return None


# --------------------------------------------------------------------------------------------
# Small file helpers
# --------------------------------------------------------------------------------------------


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gemel", "tokenizers")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _write_atomically(path: Path, text: str) -> None:
    """Write a cache file so that concurrent loaders never see a half-written one."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # a shared cache; mkstemp creates 0600
        os.replace(tmp, path)
    except OSError as exc:  # caching is an optimisation only
        logger.warning("could not write tokenizer cache %s: %s", path, exc)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
