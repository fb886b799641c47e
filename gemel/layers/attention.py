"""Attention over the paged KV cache.

Per step the model runner builds one :class:`AttentionMetadata`: where each new token's
K/V goes (``slot_mapping``) and, for each group of sequences, index tensors that gather
their queries and their whole context from the paged cache into a padded batch. Every
layer then does one ``index_copy_`` and one SDPA call per group; there is no Python loop
over sequences or blocks in the layer. Decodes (one query token) and prefills form
separate groups so a long prefill does not pad every decode to its length. On CPU, decode
and prefill groups can instead go through a C++ kernel that reads the cache in place
(``AttentionMetadata.decode_kernel``, see :mod:`gemel.layers.cpu_kernels`): for a prefill
group, each query token attends to its own causal prefix (2.6x faster than the padded SDPA
call for 32 prompts of 128 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gemel.layers.kv_cache import dequantize_rows, is_int8, kernels_take, quantize_rows


@dataclass
class AttentionGroup:
    query_index: torch.Tensor  # [B, max_q] rows of the step's flat token dimension (padding -> 0)
    valid_rows: torch.Tensor  # positions in the flattened [B * max_q] layout that are real tokens
    token_rows: torch.Tensor  # the flat token rows those valid positions belong to
    kv_slots: torch.Tensor  # [B, max_ctx] cache slots of each sequence's context (padding -> 0)
    mask: torch.Tensor | None  # [B, 1, max_q, max_ctx] True where a query may attend (causal)
    sliding_mask: torch.Tensor | None  # same, restricted to the sliding window
    is_decode: bool = False  # one query per sequence: attention as two small batched matmuls
    bias: torch.Tensor | None = None  # decode only: [1, B, 1, max_ctx] float32, 0 or -inf
    sliding_bias: torch.Tensor | None = None
    # Decode only: cache slots of a context prefix every sequence of the group shares (the
    # same physical blocks, from the prefix cache or forking). kv_slots then hold only each
    # sequence's own tail, and the shared part is attended once for the whole group.
    shared_slots: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None  # [B] int64: valid entries of each row of kv_slots
    sliding_window: int = 0  # window of the sliding-window layers (0: the model has none)
    # Prefill only, per query token in token_rows order: its sequence (row of kv_slots) and
    # how many keys it sees (position + 1), for the C++ kernel.
    token_seq: torch.Tensor | None = None
    token_context_lens: torch.Tensor | None = None
    # (first row, count) when token_rows are consecutive rows of the step, as in a plain
    # decode step, or a prefill group after the step's decodes: the kernels then read the
    # queries in place and the output is copied into one slice, with no gather nor scatter.
    token_slice: tuple[int, int] | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    groups: list[AttentionGroup]
    num_tokens: int
    # Plain decode and prefill groups use the paged C++ kernel (CPU, loaded by the runner).
    decode_kernel: bool = False
    # The layers' RMSNorm, SiLU-and-mul and rotary run as fused C++ ops (CPU, eager steps;
    # a torch.compile'd step fuses the PyTorch versions itself). See layers/fused.py.
    fused_ops: bool = False


def build_group(
    seq_rows: list[range],
    query_positions: list[list[int]],
    context_slots: list[list[int]] | list[np.ndarray] | np.ndarray,
    sliding_window: int | None,
    device: torch.device,
    shared_slots: list[int] | None = None,
    masks: bool = True,
    context_lens: np.ndarray | None = None,
) -> AttentionGroup:
    """Index tensors for sequences attended with one padded SDPA call.

    ``seq_rows[b]``: flat token rows of sequence b's new tokens; ``query_positions[b]``:
    their absolute positions; ``context_slots[b]``: cache slots of positions 0..ctx-1, or,
    with ``shared_slots`` (decodes without a sliding window only), of the positions after
    that shared prefix. ``masks=False``, for decodes that the C++ kernel attends (it reads
    the context lengths and the window): no masks nor biases, some ten tensor ops a step.
    With ``context_lens``, ``context_slots`` is already the padded [B, max_ctx] array of
    :func:`context_slot_array`, taken as it is.
    """
    batch = len(seq_rows)
    query_lens = [len(r) for r in seq_rows]
    max_q = max(query_lens)
    # Filled in numpy and handed to torch once: a tensor per row costs microseconds each,
    # which at batch 32 added up to half a millisecond a step.
    if context_lens is None:
        ctx_len_np = np.fromiter((len(c) for c in context_slots), dtype=np.int64, count=batch)
        kv_slots_np = np.zeros((batch, int(ctx_len_np.max())), dtype=np.int64)
        for b, slots in enumerate(context_slots):
            kv_slots_np[b, : len(slots)] = slots
    else:
        ctx_len_np = np.asarray(context_lens, dtype=np.int64)
        kv_slots_np = np.asarray(context_slots, dtype=np.int64)
    max_ctx = kv_slots_np.shape[1]
    if min(query_lens) == max_q == 1:  # decodes: one query row each, no padding
        token_rows = [r.start for r in seq_rows]
        query_index_np = np.asarray(token_rows, dtype=np.int64).reshape(batch, 1)
        q_pos_np = np.asarray([p[0] for p in query_positions], dtype=np.int64).reshape(batch, 1)
        valid_rows = list(range(batch))
    else:
        query_index_np = np.zeros((batch, max_q), dtype=np.int64)
        q_pos_np = np.full((batch, max_q), -1, dtype=np.int64)
        valid_rows, token_rows = [], []
        for b, (rows, pos) in enumerate(zip(seq_rows, query_positions)):
            n = len(rows)
            query_index_np[b, :n] = rows
            q_pos_np[b, :n] = pos
            valid_rows.extend(range(b * max_q, b * max_q + n))
            token_rows.extend(rows)
    rows_np = np.asarray(token_rows, dtype=np.int64)
    consecutive = rows_np.size > 0 and bool((np.diff(rows_np) == 1).all())
    query_index, kv_slots = torch.from_numpy(query_index_np), torch.from_numpy(kv_slots_np)
    q_pos, ctx_len = torch.from_numpy(q_pos_np), torch.from_numpy(ctx_len_np)
    is_decode = max_q == 1
    mask = sliding = None
    if masks or not is_decode or shared_slots is not None:
        k_pos = torch.arange(max_ctx).view(1, 1, max_ctx)
        qp = q_pos.unsqueeze(-1)
        mask = (k_pos <= qp) & (k_pos < ctx_len.view(batch, 1, 1))
        if sliding_window is not None:
            sliding = mask & (k_pos > qp - sliding_window)
            sliding[..., 0] |= q_pos < 0  # padding rows attend somewhere, avoiding NaN
            sliding = sliding.unsqueeze(1).to(device)
        mask[..., 0] |= q_pos < 0

    def bias(m):
        if not is_decode:
            return None
        zero = torch.zeros((), dtype=torch.float32)
        return torch.where(m, zero, float("-inf")).view(1, batch, 1, max_ctx).to(device)

    return AttentionGroup(
        query_index=query_index.to(device),
        valid_rows=torch.as_tensor(valid_rows, dtype=torch.long, device=device),
        token_rows=torch.as_tensor(token_rows, dtype=torch.long, device=device),
        kv_slots=kv_slots.to(device),
        mask=None if mask is None else mask.unsqueeze(1).to(device),
        sliding_mask=sliding,
        is_decode=is_decode,
        bias=None if mask is None else bias(mask[:, 0, :]),
        sliding_bias=None if sliding is None else bias(sliding[:, 0, 0, :]),
        shared_slots=torch.as_tensor(shared_slots, dtype=torch.long, device=device) if shared_slots is not None else None,
        context_lens=ctx_len.to(device),
        sliding_window=sliding_window or 0,
        token_seq=None if is_decode else _sequence_of_each_token(seq_rows).to(device),
        token_context_lens=None if is_decode else (q_pos.view(-1)[valid_rows] + 1).to(device),
        token_slice=(int(rows_np[0]), int(rows_np.size)) if consecutive else None,
    )


def context_slot_array(block_tables: list[list[int]], context_lens: list[int], block_size: int) -> np.ndarray:
    """[B, max(context_lens)] int64: the cache slot of each of sequence b's positions 0..len-1
    (zero past its length), from the block tables, in a few numpy operations for the whole
    batch. Done a sequence at a time, from each position, it was most of a decode step's input
    preparation: 0.85 ms for 32 sequences of 2,000 tokens."""
    offsets = np.arange(block_size)
    if len(block_tables) == 1:  # one sequence (batch-1 decoding): no padding to clear
        length = int(context_lens[0])
        table = np.asarray(block_tables[0][: (length + block_size - 1) // block_size], dtype=np.int64)
        return (table[:, None] * block_size + offsets).reshape(1, -1)[:, :length]
    lens = np.asarray(context_lens, dtype=np.int64)
    blocks = (lens + block_size - 1) // block_size
    width = int(blocks.max())
    table = np.zeros((len(block_tables), width), dtype=np.int64)
    for b, (blocks_of_b, used) in enumerate(zip(block_tables, blocks.tolist())):
        table[b, :used] = blocks_of_b[:used]
    longest = int(lens.max())
    slots = (table[:, :, None] * block_size + offsets).reshape(len(block_tables), -1)
    slots = np.ascontiguousarray(slots[:, :longest])
    slots[np.arange(longest) >= lens[:, None]] = 0
    return slots


def _sequence_of_each_token(seq_rows: list[range]) -> torch.Tensor:
    """[tokens] int64: b for each of sequence b's new tokens, in token_rows order."""
    return torch.repeat_interleave(torch.arange(len(seq_rows)), torch.tensor([len(r) for r in seq_rows]))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    use_sliding_window: bool = False,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D], or None when the caller has already written them
    into the caches (``fused.rotary_q_store_kv``); caches: [Hkv, num_slots, D], or int8 rows
    of D + 4 (``layers/kv_cache.py``). Returns [T, Hq * D]."""
    if k is not None and v is not None:
        k_cache.index_copy_(1, meta.slot_mapping, _cache_rows(k, k_cache).transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, _cache_rows(v, v_cache).transpose(0, 1))
    num_tokens, num_heads, head_dim = q.shape
    gqa = num_heads != k_cache.shape[0]
    kernel = meta.decode_kernel
    if len(meta.groups) == 1 and meta.groups[0].valid_rows.numel() == num_tokens:
        o = _group_attention(q, k_cache, v_cache, meta.groups[0], scale, use_sliding_window, gqa, kernel)
        return o.reshape(num_tokens, num_heads * head_dim)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for group in meta.groups:
        o = _group_attention(q, k_cache, v_cache, group, scale, use_sliding_window, gqa, kernel)
        if group.token_slice:
            out.narrow(0, *group.token_slice).copy_(o)
        else:
            out.index_copy_(0, group.token_rows, o)
    return out.view(num_tokens, num_heads * head_dim)


def _cache_rows(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """New keys or values [T, Hkv, D] as the cache stores them."""
    return quantize_rows(x) if is_int8(cache) else x.to(cache.dtype)


def _values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows read back as [..., D] values in ``dtype``."""
    return dequantize_rows(rows, dtype) if is_int8(rows) else rows.to(dtype)


def _kernel_reads(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the C++ kernels take this cache (``kv_cache.kernels_take``)."""
    return kernels_take(q.dtype, cache)


def _gather_context(cache: torch.Tensor, kv_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[Hkv, slots, D] cache -> [Hkv, B, ctx, D] context of each sequence (one index_select)."""
    batch, ctx = kv_slots.shape
    out = cache.index_select(1, kv_slots.reshape(-1)).view(cache.shape[0], batch, ctx, cache.shape[2])
    return _values(out, dtype)


def _decode_queries(q: torch.Tensor, group: AttentionGroup, num_kv: int) -> torch.Tensor:
    """The group's one query per sequence as [Hkv, B, G, D], the GQA group G folded into rows."""
    batch, (num_heads, head_dim) = group.query_index.shape[0], q.shape[1:]
    return q[group.query_index[:, 0]].view(batch, num_kv, num_heads // num_kv, head_dim).transpose(0, 1)


def _softmax_parts(scores: torch.Tensor, values: torch.Tensor, dtype: torch.dtype):
    """Unnormalised attention over one part of the context: (max, sum of exp, weighted values)."""
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - m)
    return m, p.sum(-1, keepdim=True), torch.matmul(p.to(dtype), values).float()


def _cascade_decode_attention(q, k_cache, v_cache, group: AttentionGroup, scale):
    """Decode attention split at a prefix every sequence shares: the shared keys and values
    are gathered once and multiplied with all the group's queries as one matrix, each
    sequence's own tail goes the usual way, and the two softmax parts are merged by their
    log-sum-exp (as cascade attention does on GPUs). 32 sequences behind a 1,000-token
    system prompt then read it once per layer instead of 32 times."""
    qg = _decode_queries(q, group, k_cache.shape[0])  # [Hkv, B, G, D]
    num_kv, batch, heads_per_kv, head_dim = qg.shape
    num_heads = num_kv * heads_per_kv
    ks = _values(k_cache.index_select(1, group.shared_slots), q.dtype)  # [Hkv, S, D]
    vs = _values(v_cache.index_select(1, group.shared_slots), q.dtype)
    rows = qg.reshape(num_kv, batch * heads_per_kv, head_dim)
    m_s, l_s, o_s = _softmax_parts(torch.matmul(rows, ks.transpose(-1, -2)).float() * scale, vs, q.dtype)
    shape = (num_kv, batch, heads_per_kv)
    m_s, l_s, o_s = m_s.view(*shape, 1), l_s.view(*shape, 1), o_s.view(*shape, head_dim)
    kt = _gather_context(k_cache, group.kv_slots, q.dtype)  # [Hkv, B, T, D]
    vt = _gather_context(v_cache, group.kv_slots, q.dtype)
    m_t, l_t, o_t = _softmax_parts(torch.matmul(qg, kt.transpose(-1, -2)).float() * scale + group.bias, vt, q.dtype)
    m = torch.maximum(m_s, m_t)
    w_s, w_t = torch.exp(m_s - m), torch.exp(m_t - m)
    out = (o_s * w_s + o_t * w_t) / (l_s * w_s + l_t * w_t)
    return out.to(q.dtype).transpose(0, 1).reshape(batch, num_heads, head_dim)


def _decode_attention(q, k_cache, v_cache, group: AttentionGroup, scale, use_sliding_window, kernel=False):
    """One query per sequence. Two batched matmuls with the GQA group folded into the rows
    beat the fused SDPA kernel at these shapes on CPU (it is tuned for long queries); the
    C++ kernel, where loaded, beats both by not copying the context out of the cache."""
    if group.shared_slots is not None:
        return _cascade_decode_attention(q, k_cache, v_cache, group, scale)
    if kernel and _kernel_reads(q, k_cache):
        window = group.sliding_window if use_sliding_window else 0
        queries = q.narrow(0, *group.token_slice) if group.token_slice else q[group.query_index[:, 0]]
        return torch.ops.gemel.paged_decode_attention(
            queries, k_cache, v_cache, group.kv_slots, group.context_lens, scale, window
        )
    batch = group.query_index.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kg = _gather_context(k_cache, group.kv_slots, q.dtype)  # [Hkv, B, ctx, D]
    vg = _gather_context(v_cache, group.kv_slots, q.dtype)
    qg = _decode_queries(q, group, kg.shape[0])
    scores = torch.matmul(qg, kg.transpose(-1, -2)).float() * scale  # [Hkv, B, G, ctx]
    bias = group.sliding_bias if (use_sliding_window and group.sliding_bias is not None) else group.bias
    probs = torch.softmax(scores + bias, dim=-1).to(q.dtype)
    out = torch.matmul(probs, vg)  # [Hkv, B, G, D]
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim)


def _group_attention(q, k_cache, v_cache, group: AttentionGroup, scale, use_sliding_window, gqa, kernel=False):
    """The group's output rows, [tokens of the group, Hq, D] in ``token_rows`` order."""
    if group.is_decode:
        return _decode_attention(q, k_cache, v_cache, group, scale, use_sliding_window, kernel)
    if kernel and _kernel_reads(q, k_cache):
        window = group.sliding_window if use_sliding_window else 0
        queries = q.narrow(0, *group.token_slice) if group.token_slice else q[group.token_rows]
        return torch.ops.gemel.paged_prefill_attention(
            queries, k_cache, v_cache, group.kv_slots, group.token_seq, group.token_context_lens, scale, window
        )
    batch, max_q = group.query_index.shape
    qg = q[group.query_index].transpose(1, 2)  # [B, Hq, max_q, D]
    kg = _gather_context(k_cache, group.kv_slots, q.dtype).transpose(0, 1)  # [B, Hkv, max_ctx, D]
    vg = _gather_context(v_cache, group.kv_slots, q.dtype).transpose(0, 1)
    mask = group.sliding_mask if (use_sliding_window and group.sliding_mask is not None) else group.mask
    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2).reshape(batch * max_q, q.shape[1], q.shape[2])[group.valid_rows]
