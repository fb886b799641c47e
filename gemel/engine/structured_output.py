"""Structured output: grammar-constrained decoding with llguidance.

Why llguidance (not xgrammar): it is a self-contained Rust wheel with no Python
dependencies (xgrammar pulls in transformers and triton), imports in ~60 ms, builds its
tokenizer straight from the ``tokenizers`` JSON gemel already has, and computes a token
mask in tens of microseconds on CPU without an up-front per-grammar compile of the whole
vocabulary. vLLM V1 ships it as its ``guidance`` backend.

Each constrained sequence owns a matcher. Before sampling, the rows of constrained
sequences get a token bitmask applied to their logits inside the batched sampler, so
constrained and free requests share one batch; after sampling the chosen token is fed
to the matcher. Matchers for a schema are built once (cached) on a worker thread and
deep-copied per request, so compilation never stalls a step.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the API process validates specs without loading torch (hundreds of MB)
    import torch

KINDS = ("json_object", "json_schema", "regex", "choice", "lark")
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What the output must match. ``spec`` is schema JSON text, a regex, a JSON list of
    choices or a Lark grammar; empty for ``json_object``."""

    kind: str
    spec: str = ""

    def grammar(self) -> str:
        import llguidance

        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r} (use one of {KINDS})")
        if self.kind in ("json_object", "json_schema"):
            schema = {"type": "object"} if self.kind == "json_object" else json.loads(self.spec)
            if isinstance(schema, dict) and "x-guidance" not in schema:
                # Compact separators instead of "any whitespace": small models otherwise
                # wander into endless newlines inside an object. Still plain JSON.
                schema = {**schema, "x-guidance": _COMPACT_JSON}
            return llguidance.grammar_from("json_schema", json.dumps(schema))
        fmt = {"regex": "regex", "choice": "choice", "lark": "lark"}[self.kind]
        return llguidance.grammar_from(fmt, self.spec)


def validate(spec: StructuredOutputSpec) -> str | None:
    """An error message if the grammar cannot be used, else None (cheap; front ends call it)."""
    import llguidance

    try:
        grammar = spec.grammar()
    except (ValueError, TypeError) as exc:
        return str(exc)
    ok, message = _validate_grammar(llguidance, grammar)
    return None if ok else message


def _validate_grammar(llguidance, grammar: str) -> tuple[bool, str]:
    result = llguidance.LLMatcher.validate_grammar(grammar)
    if isinstance(result, tuple):  # (is_error, messages) in some releases
        is_error, messages = result[0], result[1]
        return (not is_error), "; ".join(messages) if isinstance(messages, list) else str(messages)
    return (not result), str(result)


class StructuredOutputManager:
    """Matchers of the running constrained sequences, and their per-step bitmask."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids[0])
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemel-grammar")
        self._templates: dict[StructuredOutputSpec, Future] = {}
        self._lock = threading.Lock()
        self.matchers: dict[str, object] = {}
        self.pending: dict[str, Future] = {}
        self.replay: dict[str, list[int]] = {}  # output tokens to feed a resumed sequence's new matcher

    def _template(self, spec: StructuredOutputSpec) -> Future:
        with self._lock:
            fut = self._templates.get(spec)
            if fut is None:
                fut = self._pool.submit(lambda: self._llg.LLMatcher(self.tokenizer, spec.grammar()))
                self._templates[spec] = fut
            return fut

    def add(self, seq_id: str, spec: StructuredOutputSpec, replay: list[int] | None = None) -> None:
        """Constrain ``seq_id``; ``replay`` are output tokens it produced already (a request
        resumed after an engine restart), fed to its matcher once the grammar is built."""
        self.pending[seq_id] = self._template(spec)
        if replay:
            self.replay[seq_id] = list(replay)

    def is_ready(self, seq_id: str) -> bool:
        """False while the sequence's grammar is still being built (the scheduler waits)."""
        fut = self.pending.get(seq_id)
        if fut is None:
            return True
        if not fut.done():
            return False
        del self.pending[seq_id]
        matcher = self.matchers[seq_id] = fut.result().deep_copy()
        for token_id in self.replay.pop(seq_id, ()):
            matcher.consume_token(token_id)
        return True

    def wait_any(self, timeout: float) -> None:
        from concurrent.futures import FIRST_COMPLETED, wait

        wait(list(self.pending.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def remove(self, seq_id: str) -> None:
        self.pending.pop(seq_id, None)
        self.replay.pop(seq_id, None)
        self.matchers.pop(seq_id, None)

    def apply_mask(self, logits: torch.Tensor, seq_ids: list[str]) -> None:
        """Forbid, in place, every token a constrained row's grammar does not allow next."""
        import torch
        from llguidance.torch import fill_next_token_bitmask

        rows = [(i, self.matchers[s]) for i, s in enumerate(seq_ids) if s in self.matchers]
        if not rows:
            return
        bitmask = torch.empty((len(rows), (self.vocab_size + 31) // 32), dtype=torch.int32)
        for k, (_, matcher) in enumerate(rows):
            fill_next_token_bitmask(matcher, bitmask, k)
        apply_bitmask_(logits, bitmask, [i for i, _ in rows], self.vocab_size)

    def accept(self, seq_id: str, token_id: int) -> bool:
        """Feed the sampled token; True when the grammar is complete (the sequence may stop)."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return False
        matcher.consume_token(token_id)
        return matcher.is_stopped()



def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Set to -inf, in place, the logits of row ``rows[i]`` whose bit in ``bitmask[i]`` (int32
    words, bit j of word w for token 32 w + j) is clear, and those of ids past ``vocab_size``
    (padding). CPU logits take gemel's C++ op (``csrc/token_mask.cpp``), others PyTorch ops.
    Not llguidance's own helper: it is a torch.compile'd kernel, which compiles for 1-6 s at the
    first constrained request, and which, loaded from Inductor's cache after a change of
    ``ATEN_CPU_CAPABILITY`` (AVX-512 code run beside AVX2 kernels, as a benchmark capped at AVX2
    does), left forbidden tokens allowed."""
    import torch

    from gemel.layers import cpu_kernels

    index = torch.tensor(rows, dtype=torch.long)
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(-1) == 1 and cpu_kernels.load():
        torch.ops.gemel.apply_token_bitmask(logits, bitmask, index, vocab_size)
        return
    index = index.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : min(vocab_size, logits.shape[-1])]
    picked = logits[index]
    picked[:, : allowed.shape[1]].masked_fill_(allowed == 0, float("-inf"))
    picked[:, vocab_size:] = float("-inf")
    logits[index] = picked
