"""Near-duplicate prompts: the nearest earlier prompt by sentence embedding.

Each partition (tenant, model, answer-changing knobs; ``keys.partition_key``) has a FAISS
``IndexFlatIP`` over unit vectors, so inner product is cosine similarity and the search is
exact. A row names the exact-cache entry of the prompt it came from; a hit is that entry,
read from the store like an exact hit, so the Redis backend's entries serve every front end
while each front end's index holds the prompts it has seen itself. Rows expire with their
entries (``ttl_s``) and the oldest go first past ``max_entries``. FAISS is imported only
when a semantic cache is built.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

Embed = Callable[[str], Awaitable["np.ndarray | None"]]

_WORDS = re.compile(r"[^\W_]+(?:'[^\W_]+)?")
_NUMBERS = re.compile(r"\d+(?:[.,]\d+)*")
_NEGATIONS = frozenset({"not", "no", "never", "nor", "none", "nothing", "without", "cannot"})


def _negated(words: list[str]) -> bool:
    return any(w in _NEGATIONS or w.endswith("n't") for w in words)


def same_question(a: str, b: str) -> bool:
    """Whether two prompts close in embedding space may still be the same question. Sentence
    embeddings barely see word order, numbers or a negation: "convert 10 miles to km" and "convert
    10 km to miles" score 0.99. So the numbers must be the same, both or neither negated, and the
    same words in another order are a different question. Only ever turns a hit into a miss."""
    if _NUMBERS.findall(a) != _NUMBERS.findall(b):
        return False
    wa, wb = _WORDS.findall(a.lower()), _WORDS.findall(b.lower())
    if _negated(wa) != _negated(wb):
        return False
    return wa == wb or sorted(wa) != sorted(wb)


def conversation_text(messages: list[dict]) -> str:
    """What is embedded of a conversation: its messages' text without the chat template (whose
    markup every prompt shares), the user's bare, other roles named."""
    lines = []
    for m in messages:
        content = m.get("content") or ""
        role = m.get("role", "user")
        lines.append(content if role == "user" else f"{role}: {content}")
    return "\n".join(lines)


@dataclass
class _Partition:
    index: Any  # faiss.IndexIDMap2 over an IndexFlatIP
    rows: dict[int, tuple[str, float, str]] = field(default_factory=dict)  # row id -> (entry key, expires at, text)
    by_key: dict[str, int] = field(default_factory=dict)


class SemanticIndex:
    """The prompts this front end has seen, by partition, searchable by cosine similarity."""

    def __init__(self, dims: int, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic):
        import faiss
        import numpy as np

        self.faiss = faiss
        self.np = np
        self.dims = dims
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self.partitions: dict[str, _Partition] = {}
        self._order: OrderedDict[int, str] = OrderedDict()  # row id -> partition, oldest first
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._order)

    def _unit(self, vector) -> np.ndarray:
        v = self.np.ascontiguousarray(self.np.asarray(vector, dtype=self.np.float32).reshape(1, -1))
        self.faiss.normalize_L2(v)
        return v

    def add(self, partition: str, vector, key: str, text: str) -> None:
        """Index ``vector`` (the embedding of prompt ``text``) as leading to entry ``key``."""
        part = self.partitions.get(partition)
        if part is None:
            part = self.partitions[partition] = _Partition(self.faiss.IndexIDMap2(self.faiss.IndexFlatIP(self.dims)))
        old = part.by_key.get(key)
        if old is not None:
            self._remove(partition, old)
        row = self._next_id
        self._next_id += 1
        part.index.add_with_ids(self._unit(vector), self.np.array([row], dtype=self.np.int64))
        part.rows[row] = (key, self.clock() + self.ttl_s, text)
        part.by_key[key] = row
        self._order[row] = partition
        while len(self._order) > self.max_entries:
            oldest, where = next(iter(self._order.items()))
            self._remove(where, oldest)

    def search(self, partition: str, vector, threshold: float, text: str | None = None, k: int = 4) -> list[tuple[str, float]]:
        """Entry keys of the nearest prompts at least ``threshold`` similar to ``vector`` (and,
        given the query's ``text``, passing ``same_question``), nearest first; expired rows are
        dropped on the way."""
        part = self.partitions.get(partition)
        if part is None or part.index.ntotal == 0:
            return []
        scores, ids = part.index.search(self._unit(vector), min(k, part.index.ntotal))
        now = self.clock()
        found = []
        for score, row in zip(scores[0].tolist(), ids[0].tolist()):
            if row < 0 or row not in part.rows:
                continue
            key, expires, seen = part.rows[row]
            if expires <= now:
                self._remove(partition, row)
            elif score >= threshold and (text is None or same_question(text, seen)):
                found.append((key, score))
        return found

    def discard(self, partition: str, key: str) -> None:
        """Forget the row of an entry the store no longer has."""
        part = self.partitions.get(partition)
        row = part.by_key.get(key) if part is not None else None
        if row is not None:
            self._remove(partition, row)

    def _remove(self, partition: str, row: int) -> None:
        part = self.partitions[partition]
        key, _, _ = part.rows.pop(row)
        if part.by_key.get(key) == row:
            del part.by_key[key]
        part.index.remove_ids(self.np.array([row], dtype=self.np.int64))
        self._order.pop(row, None)
        if not part.rows:
            del self.partitions[partition]


def server_embedder(state: Any, timeout_s: float = 5.0) -> tuple[Embed | None, int]:
    """The server's embedding model as ``(embed(text) -> unit vector or None, dimensions)``;
    (None, 0) when it serves none. ``embed`` answers None while the model is loading and for
    a text longer than the model reads (it would be truncated: two long prompts that differ
    only past the cut would look identical)."""
    model = next((m for m in state.models if m.kind == "embed" and m.failure is None), None)
    if model is None:
        return None, 0
    from gemel.loader import sources

    dims = _dimensions(sources.resolve(model.source))

    async def embed(text: str):
        if not text or not model.loaded:
            return None
        encoder = model.encoder_task.result()
        if len(text) > encoder.max_seq_length * 16:  # more characters than that many tokens could hold
            return None
        if encoder.count_tokens([text])[0] >= encoder.max_seq_length:
            return None
        vectors = await state.embed(model, [text], timeout_s)
        return vectors[0].numpy()

    return embed, dims


def _dimensions(path: str) -> int:
    """The embedding size of a sentence-transformers directory (its config's hidden size)."""
    import json
    import os

    with open(os.path.join(path, "config.json")) as f:
        return int(json.load(f)["hidden_size"])
