"""The rows of a step whose hidden states are read out.

A step with prompt tokens reads out one row per sequence that finishes its prompt (and the
rows of draft tokens to verify), yet every layer computes every row. In the last layer only
the K and V of the other rows matter, and those reach the cache before its attention output
is used, so from there on the layer can drop them: the attention output projection, the MLP
and the final norm then run on the rows read out alone (about 5/6 of a Llama layer's
multiply-adds, for every prompt token but a prompt's last).
"""

from __future__ import annotations

import torch


def keep_rows(x: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream ``x`` and attention output ``attn`` at ``rows`` (all where None)."""
    if rows is None:
        return x, attn
    return x.index_select(0, rows), attn.index_select(0, rows)
