"""Decode attention over the paged cache: the cascaded form (shared prefix attended once)
equals the plain per-sequence form."""

from __future__ import annotations

import numpy as np
import torch

from gemel.engine.model_runner import shared_prefix_len
from gemel.layers.attention import AttentionMetadata, build_group, paged_attention


def test_cascade_equals_plain_decode_attention():
    torch.manual_seed(0)
    num_kv, heads, dim, slots = 2, 6, 16, 512
    k_cache, v_cache = torch.randn(num_kv, slots, dim), torch.randn(num_kv, slots, dim)
    shared = list(range(100, 164))  # 64 shared positions (four 16-slot blocks)
    tails = [list(range(300, 305)), list(range(320, 341)), list(range(400, 401))]
    contexts = [shared + t for t in tails]
    q = torch.randn(3, heads, dim)
    k_new, v_new = torch.randn(3, num_kv, dim), torch.randn(3, num_kv, dim)
    rows = [range(i, i + 1) for i in range(3)]
    positions = [[len(c) - 1] for c in contexts]
    slot_mapping = torch.tensor([c[-1] for c in contexts])
    plain = build_group(rows, positions, contexts, None, torch.device("cpu"))
    cascade = build_group(rows, positions, tails, None, torch.device("cpu"), shared_slots=shared)
    outs = []
    for group in (plain, cascade):
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = AttentionMetadata(slot_mapping=slot_mapping, groups=[group], num_tokens=3)
        outs.append(paged_attention(q, k_new, v_new, kc, vc, meta, scale=dim**-0.5))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_shared_prefix_len_counts_whole_common_blocks():
    a = np.arange(0, 40)
    b = np.concatenate([np.arange(0, 20), np.arange(100, 130)])
    assert shared_prefix_len([a, b], block_size=8) == 16  # 20 equal slots -> two whole blocks
    assert shared_prefix_len([a, a.copy()], block_size=8) == 32  # each keeps >= 1 token of its own
    assert shared_prefix_len([a, np.arange(50, 90)], block_size=8) == 0
