"""Sentence embeddings: a small BERT encoder plus sentence-transformers pooling."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gemel.embeddings.encoder import SentenceEncoder

__all__ = ["SentenceEncoder"]


def __getattr__(name: str) -> Any:
    # The encoder needs torch; the API layers import gemel.embeddings.vectors without it.
    if name == "SentenceEncoder":
        from gemel.embeddings.encoder import SentenceEncoder

        return SentenceEncoder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
