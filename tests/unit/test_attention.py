"""Decode attention over the paged cache: the cascaded form (shared prefix attended once)
and the C++ kernel equal the plain per-sequence form."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from gemel.engine.model_runner import shared_prefix_len
from gemel.layers import cpu_kernels
from gemel.layers.attention import AttentionMetadata, build_group, context_slot_array, paged_attention
from gemel.layers.kv_cache import quantize_rows


def _cache(values: torch.Tensor, dtype: torch.dtype, kv: str) -> torch.Tensor:
    """A cache holding values: in dtype, as int8 rows with their scales (kv="int8"), or as
    float16 (kv="float16": the AVX2 plan's cache under float32 queries)."""
    if kv == "int8":
        return quantize_rows(values)
    return values.half() if kv == "float16" else values.to(dtype)


@pytest.mark.parametrize("kv", ["model", "int8"])
def test_cascade_equals_plain_decode_attention(kv):
    torch.manual_seed(0)
    num_kv, heads, dim, slots = 2, 6, 16, 512
    k_cache = _cache(torch.randn(num_kv, slots, dim), torch.float32, kv)
    v_cache = _cache(torch.randn(num_kv, slots, dim), torch.float32, kv)
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


def _kernel_available() -> bool:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the PyTorch decode path is used instead")
    assert cpu_kernels.load(), "a C++ compiler is present but the CPU kernels did not build"
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize("dim", [64, 128, 24])  # 24: not a multiple of 16, the kernel's plain C++ loops
@pytest.mark.parametrize("group", [1, 3, 4, 8])  # query heads per KV head
@pytest.mark.parametrize("kv", ["model", "int8"])  # cache in the model's dtype, or int8 rows
def test_decode_kernel_equals_torch_decode_attention(dtype, sliding_window, dim, group, kv):
    """The C++ kernel reads the paged cache in place; it must give what the gather + matmul
    path gives: GQA, contexts of different lengths scattered over blocks, sliding window.
    bf16 with head sizes 64 and 128 takes its AVX512-BF16 path where the CPU has one (group
    8 at head size 128: scores there, value sums in the generic loop). int8 caches take
    their AVX-512 path at head size 64 with groups up to 4 and 128 up to 2, and the generic
    loops elsewhere. The kernel's group is built without masks (it reads the context lengths
    and the window), as the runner builds it when the kernel attends its decodes."""
    _kernel_available()
    torch.manual_seed(0)
    num_kv, num_slots, block = 2, 1024, 16
    heads = group * num_kv
    k_cache = _cache(torch.randn(num_kv, num_slots, dim), dtype, kv)
    v_cache = _cache(torch.randn(num_kv, num_slots, dim), dtype, kv)
    blocks = torch.randperm(num_slots // block).tolist()
    lengths = [1, 7, 40, 129]
    contexts, used = [], 0
    for n in lengths:  # each sequence on its own shuffled blocks, as the block manager hands them out
        count = -(-n // block)
        contexts.append([b * block + i for b in blocks[used : used + count] for i in range(block)][:n])
        used += count
    q = torch.randn(len(lengths), heads, dim).to(dtype)
    k_new, v_new = torch.randn(len(lengths), num_kv, dim).to(dtype), torch.randn(len(lengths), num_kv, dim).to(dtype)
    rows = [range(i, i + 1) for i in range(len(lengths))]
    groups = [build_group(rows, [[n - 1] for n in lengths], contexts, sliding_window, torch.device("cpu"), masks=masks)
              for masks in (True, False)]
    assert groups[1].mask is groups[1].bias is groups[1].sliding_bias is None and groups[0].bias is not None
    slot_mapping = torch.tensor([c[-1] for c in contexts])
    outs = []
    for kernel, group in zip((False, True), groups):
        meta = AttentionMetadata(slot_mapping=slot_mapping, groups=[group], num_tokens=len(lengths), decode_kernel=kernel)
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(paged_attention(q, k_new, v_new, kc, vc, meta, scale=dim**-0.5,
                                    use_sliding_window=sliding_window is not None).float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("sliding_window", [None, 300])
@pytest.mark.parametrize("kv", ["model", "int8", "float16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_long_decodes_split_their_keys_across_threads(threads, sliding_window, kv, dtype):
    """With fewer decode tasks than threads to keep busy (one sequence, one KV head: Gemma 3 at
    batch 1), the kernel cuts each task's keys into runs attended on different threads and
    merges the runs' softmax sums after; the result must be the unsplit one. Contexts of 1,000
    keys (cut), 2,000 beside a 63-key one (the short one too short to cut), and 63 alone."""
    _kernel_available()
    if kv == "float16" and dtype != torch.float32:
        pytest.skip("a float16 cache is kept under float32 queries only")
    torch.manual_seed(3)
    num_slots, block, dim, heads = 4096, 16, 64, 4
    k_cache = _cache(torch.randn(1, num_slots, dim), dtype, kv)
    v_cache = _cache(torch.randn(1, num_slots, dim), dtype, kv)
    blocks = torch.randperm(num_slots // block).tolist()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lengths in ([1000], [2000, 63], [63]):
            contexts, used = [], 0
            for n in lengths:
                count = -(-n // block)
                contexts.append([b * block + i for b in blocks[used : used + count] for i in range(block)][:n])
                used += count
            q = torch.randn(len(lengths), heads, dim).to(dtype)
            rows = [range(i, i + 1) for i in range(len(lengths))]
            outs = []
            for kernel in (False, True):
                group = build_group(rows, [[n - 1] for n in lengths], contexts, sliding_window, torch.device("cpu"),
                                    masks=not kernel)
                meta = AttentionMetadata(slot_mapping=torch.tensor([c[-1] for c in contexts]), groups=[group],
                                         num_tokens=len(lengths), decode_kernel=kernel)
                outs.append(paged_attention(q, None, None, k_cache, v_cache, meta, scale=dim**-0.5,
                                            use_sliding_window=sliding_window is not None).float())
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(previous)


def test_decode_queries_read_in_place_only_when_consecutive():
    """A decode group over consecutive rows hands the kernel q's rows in place; any other
    order gathers them, with the same result per sequence."""
    _kernel_available()
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(2, 256, 64), torch.randn(2, 256, 64)
    contexts = [list(range(0, 20)), list(range(32, 45)), list(range(64, 100))]
    q = torch.randn(5, 4, 64)
    cpu = torch.device("cpu")

    def run(rows, queries):
        group = build_group([range(r, r + 1) for r in rows], [[len(c) - 1] for c in contexts], contexts, None, cpu)
        meta = AttentionMetadata(slot_mapping=torch.tensor([c[-1] for c in contexts]), groups=[group],
                                 num_tokens=5, decode_kernel=True)
        return group.token_slice, paged_attention(queries, None, None, k_cache, v_cache, meta, scale=0.125)

    in_place, a = run([1, 2, 3], q)
    shuffled = q.clone()
    shuffled[[3, 1, 4]] = q[[1, 2, 3]]  # the same three queries at rows 3, 1, 4
    gathered, b = run([3, 1, 4], shuffled)
    assert in_place == (1, 3) and gathered is None
    torch.testing.assert_close(b[[3, 1, 4]], a[[1, 2, 3]])
    # prefill groups: a slice when their token rows are consecutive (after the step's decodes)
    assert build_group([range(3, 5), range(5, 8)], [[0, 1], [0, 1, 2]], [[0, 1], [2, 3, 4]], None, cpu).token_slice == (3, 5)
    assert build_group([range(0, 2), range(3, 5)], [[0, 1], [0, 1]], [[0, 1], [2, 3]], None, cpu).token_slice is None


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("lengths", [[1], [37], [16, 1, 33, 32], [5, 5, 5], [200, 3, 64, 65, 129]])
def test_context_slot_array_is_each_position_looked_up_in_its_block_table(block_size, lengths):
    """The batch's context slots from its block tables in one array: position p of sequence b
    at block_tables[b][p // block_size] * block_size + p % block_size, zero past b's length
    (block tables may hold more blocks than the context uses); a decode group built from it
    is the group built from each sequence's list of slots."""
    rng = np.random.default_rng(len(lengths) * 100 + block_size)
    tables = [[int(b) for b in rng.permutation(1000)[: (n + block_size - 1) // block_size + int(rng.integers(0, 3))]]
              for n in lengths]
    slots = context_slot_array(tables, lengths, block_size)
    written_out = [[t[p // block_size] * block_size + p % block_size for p in range(n)] for t, n in zip(tables, lengths)]
    assert slots.shape == (len(lengths), max(lengths)) and slots.dtype == np.int64 and slots.flags.c_contiguous
    for row, expected in zip(slots.tolist(), written_out):
        assert row == expected + [0] * (max(lengths) - len(expected))
    cpu = torch.device("cpu")
    rows, positions = [range(b, b + 1) for b in range(len(lengths))], [[n - 1] for n in lengths]
    for masks in (True, False):
        batched = build_group(rows, positions, slots, 8, cpu, masks=masks, context_lens=np.asarray(lengths))
        listed = build_group(rows, positions, written_out, 8, cpu, masks=masks)
        for field in ("query_index", "valid_rows", "token_rows", "kv_slots", "mask", "sliding_mask", "bias",
                      "sliding_bias", "context_lens"):
            a, b = getattr(batched, field), getattr(listed, field)
            assert (a is None and b is None) or torch.equal(a, b), field
        assert batched.token_slice == listed.token_slice == (0, len(lengths))


@pytest.mark.parametrize("kv", ["model", "int8"])
def test_mixed_step_places_each_group_by_its_slice(kv):
    """A step of two decodes (rows 0-1) and a 5-token prefill (rows 2-6): each group's
    queries are read, and its output written, as one slice of the step's rows; the same
    result as the PyTorch path, and as the gather/scatter a shuffled row order needs."""
    _kernel_available()
    torch.manual_seed(2)
    cpu = torch.device("cpu")
    k_cache = _cache(torch.randn(2, 128, 64), torch.float32, kv)
    v_cache = _cache(torch.randn(2, 128, 64), torch.float32, kv)
    q = torch.randn(7, 4, 64)
    contexts = [list(range(0, 9)), list(range(16, 20)), list(range(32, 37))]

    def step(decode_rows, prefill_rows, kernel):
        groups = [build_group([range(r, r + 1) for r in decode_rows], [[8], [3]], contexts[:2], None, cpu),
                  build_group([prefill_rows], [list(range(5))], contexts[2:], None, cpu)]
        slots = torch.zeros(7, dtype=torch.long)
        meta = AttentionMetadata(slot_mapping=slots, groups=groups, num_tokens=7, decode_kernel=kernel)
        return [g.token_slice for g in groups], paged_attention(q, None, None, k_cache, v_cache, meta, scale=0.125)

    slices, kernel_out = step([0, 1], range(2, 7), kernel=True)
    assert slices == [(0, 2), (2, 5)]
    _, torch_out = step([0, 1], range(2, 7), kernel=False)
    torch.testing.assert_close(kernel_out, torch_out, atol=1e-5, rtol=1e-5)
    # the same queries with the decodes at rows 0 and 6 around the prefill: gathered and scattered
    order = [0, 6, 1, 2, 3, 4, 5]  # new row of each old row
    moved = torch.empty_like(q)
    moved[order] = q
    q = moved
    slices, moved_out = step([0, 6], range(1, 6), kernel=True)
    assert slices == [None, (1, 5)]
    torch.testing.assert_close(moved_out[order], kernel_out)


def test_engine_with_decode_kernel_matches_torch_path(tiny_model_dir):
    """Whole engine, tiny Llama and Gemma 3 (sliding window): the same greedy tokens and
    logprobs with the C++ decode attention as with the PyTorch path."""
    _kernel_available()
    from gemel import LLM, SamplingParams

    prompts = [[5, 17, 33, 90], [200, 11, 4, 4, 4, 60, 7] * 5, [150] * 12]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = []
    for kernel in (False, True):
        llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=64, cpu_attention_kernel=kernel)
        assert llm.engine.core.runner.decode_kernel is kernel
        outs.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(la.logprob - lb.logprob) < 1e-4


def test_without_a_compiler_the_engine_keeps_the_pytorch_path(tmp_path, tiny_llama_dir):
    """No C++ compiler (and nothing cached): the kernels report unavailable, the engine says
    so and serves through the PyTorch path. Run in a fresh process, as a loaded library
    cannot be unloaded."""
    import subprocess
    import sys

    code = (
        "from gemel.layers import cpu_kernels\n"
        "from gemel import LLM, SamplingParams\n"
        "assert cpu_kernels.load() is False\n"
        f"llm = LLM({tiny_llama_dir!r}, dtype='float32', num_kv_blocks=32)\n"
        "assert llm.engine.core.runner.decode_kernel is False and llm.engine.core.runner.fused_ops is False\n"
        "out = llm.generate(prompt_token_ids=[[5, 17, 33]], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "assert len(out[0].outputs[0].token_ids) == 4\n"
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "GEMEL_KERNEL_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "C++ CPU kernels unavailable" in result.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize("dim", [64, 24, 32, 128, 256])
@pytest.mark.parametrize("kv", ["model", "int8", "float16"])
@pytest.mark.parametrize("heads,num_kv", [(6, 2), (16, 1)], ids=["gqa3", "gqa16"])
def test_prefill_kernel_equals_torch_prefill_attention(dtype, sliding_window, dim, kv, heads, num_kv):
    """Prefill groups through the kernel: each query token against its own causal prefix, for
    whole prompts and for chunks after a cached prefix, mixed with decodes in one step. Head
    sizes 32, 64, 128 and 256 take the tiled path on AVX-512 (tiles of 16 tokens at 3 query
    heads per KV head, 3 at 16; contexts past its 256-key chunks; with bf16 on a CPU with AMX,
    the tile-instruction version, 32 and 6 tokens a tile), 24 and other CPUs the per-token
    one. A float16 cache under float32 queries is the AVX2 plan's."""
    if kv == "float16" and dtype != torch.float32:
        pytest.skip("a float16 cache is kept under float32 queries only")
    _kernel_available()
    torch.manual_seed(1)
    num_slots, block = 2048, 16
    k_cache = _cache(torch.randn(num_kv, num_slots, dim), dtype, kv)
    v_cache = _cache(torch.randn(num_kv, num_slots, dim), dtype, kv)
    blocks = torch.randperm(num_slots // block).tolist()
    # (tokens already cached, new tokens): a whole prompt, a one-token prompt, chunks after a
    # prefix, and a chunk whose context spans two 256-key chunks of the tiled path
    shapes = [(0, 37), (0, 1), (100, 20), (16, 64), (250, 40)]
    rows, positions, contexts, used, row = [], [], [], 0, 0
    for cached, new in shapes:
        n = cached + new
        count = -(-n // block)
        contexts.append([b * block + i for b in blocks[used : used + count] for i in range(block)][:n])
        used += count
        rows.append(range(row, row + new))
        positions.append(list(range(cached, n)))
        row += new
    decode_ctx = [b * block + i for b in blocks[used : used + 3] for i in range(block)][:41]
    prefill = build_group(rows, positions, contexts, sliding_window, torch.device("cpu"))
    decode = build_group([range(row, row + 1)], [[40]], [decode_ctx], sliding_window, torch.device("cpu"))
    num_tokens = row + 1
    q = torch.randn(num_tokens, heads, dim).to(dtype)
    k_new, v_new = torch.randn(num_tokens, num_kv, dim).to(dtype), torch.randn(num_tokens, num_kv, dim).to(dtype)
    slot_mapping = torch.tensor([c[p] for c, pos in zip(contexts, positions) for p in pos] + [decode_ctx[-1]])
    outs = []
    for kernel in (False, True):
        for groups in ([prefill], [decode, prefill]):
            tokens = prefill.token_rows.numel() if len(groups) == 1 else num_tokens
            meta = AttentionMetadata(slot_mapping=slot_mapping[:tokens], groups=groups, num_tokens=tokens,
                                     decode_kernel=kernel)
            kc, vc = k_cache.clone(), v_cache.clone()
            outs.append(paged_attention(q[:tokens], k_new[:tokens], v_new[:tokens], kc, vc, meta, scale=dim**-0.5,
                                        use_sliding_window=sliding_window is not None).float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[2], outs[0], atol=tol, rtol=tol)  # prefill alone
    torch.testing.assert_close(outs[3], outs[1], atol=tol, rtol=tol)  # with a decode in the step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 700])
@pytest.mark.parametrize("kv", ["model", "int8"])
@pytest.mark.parametrize("heads,num_kv", [(6, 2), (16, 1)], ids=["gqa3", "gqa16"])
def test_prefill_kernel_short_chunk_of_a_long_prompt(dtype, sliding_window, kv, heads, num_kv):
    """A short chunk after a long cached prefix (a late chunk of a chunked prefill): one tile
    per KV head walks six 256-key chunks of context, with a window that masks the first ones
    entirely. Same answer as the PyTorch path."""
    _kernel_available()
    torch.manual_seed(2)
    dim, num_slots, block, cached, new = 64, 4096, 16, 1500, 5
    k_cache = _cache(torch.randn(num_kv, num_slots, dim), dtype, kv)
    v_cache = _cache(torch.randn(num_kv, num_slots, dim), dtype, kv)
    blocks = torch.randperm(num_slots // block).tolist()
    context = [b * block + i for b in blocks for i in range(block)][: cached + new]
    group = build_group([range(0, new)], [list(range(cached, cached + new))], [context], sliding_window,
                        torch.device("cpu"))
    q = torch.randn(new, heads, dim).to(dtype)
    outs = []
    for kernel in (False, True):
        meta = AttentionMetadata(slot_mapping=torch.tensor(context[cached:]), groups=[group], num_tokens=new,
                                 decode_kernel=kernel)
        outs.append(paged_attention(q, None, None, k_cache, v_cache, meta, scale=dim**-0.5,
                                    use_sliding_window=sliding_window is not None).float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
