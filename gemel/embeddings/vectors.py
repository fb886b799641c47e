"""Embedding vectors after the encoder: what the API layers do to them. Importing this loads
no torch, so an API process serving no embeddings (``--no-embeddings``) never loads it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def truncate(vectors: torch.Tensor, dims: int | None) -> torch.Tensor:
    """Keep the first ``dims`` components and re-normalise (what Gemini's outputDimensionality
    and OpenAI's ``dimensions`` do)."""
    if dims is None or dims == vectors.shape[1]:
        return vectors
    import torch.nn.functional as F  # already loaded: the vectors came from the encoder

    return F.normalize(vectors[:, :dims], p=2, dim=1)
