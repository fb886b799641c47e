"""AMX tiles: bf16 projections laid out as tiles (``pack_amx_tiles``) and multiplied by
``torch.ops.gemel.amx_bf16_gemm`` for decode-sized calls, against the bf16 GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gemel.layers import cpu_kernels
from gemel.layers.linear import (
    AMX_GATE_UP,
    AMX_INT8_GROUPS_MAX_ROWS,
    AMX_PLAIN,
    AMX_SILU_MUL,
    Linear,
    gated_mlp,
    pack_amx_tiles,
    quantize_model_,
)
from gemel.models.weights import Int4Groups, Int8Groups

needs_amx = pytest.mark.skipif(not cpu_kernels.amx_tiles_available(), reason="needs a CPU with AMX-BF16")


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_tile_layout():
    """Tile (block b, group g), row r, pair lane 2n + p holds w[16 b + n, 32 g + 2 r + p]; the
    rows past the weight's last are zero."""
    w = _bf16(40, 96, seed=0)
    tiles = pack_amx_tiles(w)
    assert tiles.shape == (3, 3, 512) and tiles.dtype == torch.bfloat16
    for b, g, r, n, p in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 2, 15, 7, 1), (2, 1, 3, 7, 0), (0, 2, 9, 15, 1)]:
        assert torch.equal(tiles[b, g, 32 * r + 2 * n + p], w[16 * b + n, 32 * g + 2 * r + p])
    assert not tiles[2].view(3, 16, 16, 2)[:, :, 8:].any()  # outputs 40..47 are padding


def test_gate_up_tiles_pair_each_gate_block_with_its_up_block():
    """pack_amx_tiles(gate_up=True) on a [gate | up] weight (I = 48 outputs each): blocks go
    gate 0, up 0, gate 1, up 1, gate 2, up 2, each laid out like a plain tile."""
    w = _bf16(96, 64, seed=4)
    tiles, plain = pack_amx_tiles(w, gate_up=True), pack_amx_tiles(w)
    assert tiles.shape == plain.shape == (6, 2, 512)
    for j in range(3):
        assert torch.equal(tiles[2 * j], plain[j]) and torch.equal(tiles[2 * j + 1], plain[3 + j])
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_amx_tiles(_bf16(80, 64, seed=5), gate_up=True)


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 17, 64, 300])
@pytest.mark.parametrize("out_f, in_f", [(96, 64), (3072, 576)])
def test_gate_up_tiles_give_the_plain_product_and_silu_mul_bit_for_bit(rows, out_f, in_f):
    """From gate/up tiles the kernel writes x W^T in output order (AMX_GATE_UP) with the same
    bits as from plain tiles, or silu(gate) * up (AMX_SILU_MUL) with the same bits as the
    silu_and_mul op on that product: partial row tiles, several chunks of rows."""
    w, x = _bf16(out_f, in_f, seed=rows) * 2, _bf16(rows, in_f, seed=out_f)
    plain = torch.ops.gemel.amx_bf16_gemm(x, pack_amx_tiles(w), out_f, AMX_PLAIN)
    tiles = pack_amx_tiles(w, gate_up=True)
    assert torch.equal(torch.ops.gemel.amx_bf16_gemm(x, tiles, out_f, AMX_GATE_UP), plain)
    fused = torch.ops.gemel.amx_bf16_gemm(x, tiles, out_f, AMX_SILU_MUL)
    assert fused.shape == (rows, out_f // 2)
    assert torch.equal(fused, torch.ops.gemel.silu_and_mul(plain))


@needs_amx
def test_silu_mul_tiles_reject_what_they_cannot_pair():
    x = _bf16(4, 64, seed=2)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.gemel.amx_bf16_gemm(x, pack_amx_tiles(_bf16(48, 64, seed=1)), 48, AMX_SILU_MUL)
    with pytest.raises(RuntimeError, match="gated"):
        torch.ops.gemel.amx_bf16_gemm(x, pack_amx_tiles(_bf16(64, 64, seed=1)), 64, 3)


@needs_amx
def test_gated_mlp_takes_the_fused_tiles_for_the_calls_they_serve():
    """A gate/up projection marked as such gets gate/up tiles; gated_mlp then feeds
    silu(gate) * up from its tile kernel to the down projection for calls up to amx_max_rows
    and runs gate_up, silu_and_mul and down one by one above: both equal the unfused layer."""
    assert cpu_kernels.load()
    gate_up, down = Linear(_bf16(128, 64, seed=9) * 4), Linear(_bf16(64, 64, seed=10))
    gate_up.gate_up = True
    reference = [Linear(gate_up.weight.data.clone()), Linear(down.weight.data.clone())]
    assert gate_up.add_amx_tiles_(8) and down.add_amx_tiles_(8)
    assert gate_up.amx_layout == AMX_GATE_UP and down.amx_layout == AMX_PLAIN
    for rows in (1, 8, 9, 20):
        h = _bf16(rows, 64, seed=rows)
        assert torch.equal(gate_up(h), reference[0](h)), rows  # plain calls keep the output order
        expected = down(torch.ops.gemel.silu_and_mul(gate_up(h)))
        with torch.profiler.profile() as prof:
            got = gated_mlp(gate_up, down, h)
        assert torch.equal(got, expected), rows
        separate_silu = any(e.name == "gemel::silu_and_mul" for e in prof.events())
        assert separate_silu == (rows > 8), rows
    biased = Linear(_bf16(128, 64, seed=9), bias=_bf16(128, seed=11))
    biased.gate_up = True
    assert biased.add_amx_tiles_(8) and biased.amx_layout == AMX_PLAIN  # the bias is added after the product


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 64, 100, 300])
@pytest.mark.parametrize("out_f, in_f", [(40, 64), (300, 576), (77, 1536)])
def test_amx_gemm_equals_the_bf16_gemm(rows, out_f, in_f):
    """Partial row tiles, an odd number of output blocks, a partial last block, several K
    groups, and calls that span more than one chunk of rows or panel of outputs: the bf16
    product to within the last bit of the result (the sums' order differs)."""
    w, x = _bf16(out_f, in_f, seed=rows), _bf16(rows, in_f, seed=out_f)
    y = torch.ops.gemel.amx_bf16_gemm(x, pack_amx_tiles(w), out_f)
    exact = x.double() @ w.double().T
    assert y.shape == (rows, out_f) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), exact, rtol=2**-8, atol=1e-3 * exact.abs().max().item())
    assert (y.double() - exact).abs().max() <= (F.linear(x, w).double() - exact).abs().max() * 1.5 + 1e-6


@needs_amx
@pytest.mark.parametrize("rows", [33, 64])
def test_outputs_of_a_megabyte_and_more_are_streamed_alike(rows):
    """Outputs of 1 MB and more (an LM head's logits) are written with non-temporal stores, a
    pair of blocks at a time: the same products."""
    out_f, in_f = 16384, 64
    assert rows * out_f * 2 >= 2**20
    w, x = _bf16(out_f, in_f, seed=rows), _bf16(rows, in_f, seed=1)
    y = torch.ops.gemel.amx_bf16_gemm(x, pack_amx_tiles(w), out_f)
    exact = x.double() @ w.double().T
    torch.testing.assert_close(y.double(), exact, rtol=2**-8, atol=1e-3 * exact.abs().max().item())


@needs_amx
def test_amx_gemm_rejects_a_mismatched_layout():
    w, x = _bf16(32, 64, seed=1), _bf16(4, 64, seed=2)
    with pytest.raises(RuntimeError, match="w_tiles"):
        torch.ops.gemel.amx_bf16_gemm(x, pack_amx_tiles(w), 48)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.gemel.amx_bf16_gemm(x.float(), pack_amx_tiles(w), 32)


def _q4_linear(out_f: int, in_f: int, seed: int) -> tuple[Linear, Int4Groups]:
    g = torch.Generator().manual_seed(seed)
    scale = (torch.rand(out_f, in_f // 32, generator=g) * 0.1 + 0.01).half().float()
    groups = Int4Groups(torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8, generator=g), scale, torch.zeros_like(scale))
    lin = Linear(groups.dequantize().bfloat16())
    lin.checkpoint_int4 = lambda: groups
    return lin, groups


@needs_amx
@pytest.mark.parametrize("int8_act_max_rows", [None, 12])
def test_calls_take_the_tiles_between_the_weight_only_and_the_larger_kernels(int8_act_max_rows):
    """Weight-only kernels up to packed_max_rows, then the tiles up to amx_max_rows (plain and
    gated), then int8_act_gemm up to its limit, then the bf16 GEMM."""
    assert cpu_kernels.load()
    lin, groups = _q4_linear(64, 128, seed=3)
    model = torch.nn.Sequential(lin)
    quantize_model_(model, "checkpoint", packed_max_rows=2, int8_activations=True,
                    int8_act_max_rows=int8_act_max_rows, amx_max_rows=8)
    assert lin.amx_max_rows == 8 and lin.amx_tiles.shape == (4, 4, 512)
    dense = groups.dequantize().bfloat16()
    weight_only = _q4_linear(64, 128, seed=3)[0]
    weight_only.quantize_("checkpoint", packed_max_rows=2)

    def tiles(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.gemel.amx_bf16_gemm(x, lin.amx_tiles, 64)

    def int8_act(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.gemel.int8_act_gemm(x, lin.act_codes, lin.act_scale, lin.act_low, 64, False, 8)

    for rows in (1, 2, 3, 8, 9, 12, 13):
        x = _bf16(rows, 128, seed=rows)
        if rows <= 2:
            expected = weight_only(x)
        elif rows <= 8:
            expected = tiles(x)
        elif int8_act_max_rows is None or rows <= int8_act_max_rows:
            expected = int8_act(x)
        else:
            expected = F.linear(x, dense)
        assert torch.equal(lin(x), expected), rows
    gate_up = _bf16(5, 256, seed=7)
    assert torch.equal(lin.forward_gated(gate_up), tiles(torch.ops.gemel.silu_and_mul(gate_up)))
    # the tiles hold the dense weight: their product is the bf16 GEMM's up to the sums' order
    x = _bf16(6, 128, seed=8)
    torch.testing.assert_close(tiles(x).float(), F.linear(x, dense).float(), rtol=2**-7, atol=1e-2)


@needs_amx
def test_q8_0_groups_serve_two_rows_and_the_tiles_more():
    """A Q8_0 projection (an LM head) with AMX tiles: int8_group_mm, which widens every weight
    to float per row of x, only up to AMX_INT8_GROUPS_MAX_ROWS rows; the tiles from there on.
    Without tiles the int8 kernel keeps its 8 rows."""
    assert cpu_kernels.load()
    g = torch.Generator().manual_seed(11)
    groups = Int8Groups(torch.randint(-127, 128, (96, 128), dtype=torch.int8, generator=g),
                        (torch.rand(96, 4, generator=g) * 0.01 + 0.001).half().float())

    def q8_linear() -> Linear:
        lin = Linear(groups.dequantize().bfloat16())
        lin.checkpoint_int8 = lambda: groups
        return lin

    lin = q8_linear()
    quantize_model_(torch.nn.Sequential(lin), "checkpoint", packed_max_rows=8, amx_max_rows=16)
    assert lin.quant == "int8_groups" and lin.packed_max_rows == AMX_INT8_GROUPS_MAX_ROWS == 2
    plain = q8_linear()
    plain.quantize_("checkpoint", packed_max_rows=8)
    assert plain.packed_max_rows == 8
    for rows in (1, 2, 3, 8):
        x = _bf16(rows, 128, seed=20 + rows)
        groups_out = torch.ops.gemel.int8_group_mm(x, lin.w_q8, lin.w_q8_scales)
        tiles_out = torch.ops.gemel.amx_bf16_gemm(x, lin.amx_tiles, 96)
        assert torch.equal(lin(x), groups_out if rows <= 2 else tiles_out), rows
        assert torch.equal(plain(x), groups_out), rows


def test_only_bf16_cpu_weights_get_tiles():
    assert not Linear(torch.randn(32, 64)).add_amx_tiles_(16)  # float32
    assert not Linear(torch.randn(32, 48).bfloat16()).add_amx_tiles_(16)  # K not whole groups of 32
    assert not Linear(torch.randn(32, 64).bfloat16()).add_amx_tiles_(0)
