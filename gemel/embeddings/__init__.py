"""Sentence embeddings (SPEC F35): a small BERT encoder plus sentence-transformers pooling."""

from gemel.embeddings.encoder import SentenceEncoder

__all__ = ["SentenceEncoder"]
