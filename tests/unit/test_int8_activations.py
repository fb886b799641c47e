"""int8_activations: larger projections on the checkpoint's weight groups with x rounded to
int8 per group of 32 (``torch.ops.gemel.int8_act_gemm``), against that arithmetic written
out in PyTorch."""

from __future__ import annotations

import pytest
import torch

from gemel.layers import cpu_kernels, kernel_plan
from gemel.layers.linear import Linear, quantize_model_, share_tied_table_
from gemel.models.weights import Int4Groups, Int8Groups


def _int4_groups(out_f: int, in_f: int, seed: int, symmetric: bool = False, half: bool = False) -> Int4Groups:
    """Q4_1-like groups (w = scale * q + low), or with ``symmetric`` Q4_0-like (w = scale * (q - 8));
    ``half``: scales and lows that float16 holds exactly, as a GGUF file's."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(out_f, in_f // 32, generator=g) * 0.1 + 0.01
    low = torch.randn(out_f, in_f // 32, generator=g) * 0.1
    if half:
        scale, low = scale.half().float(), low.half().float()
    zero = torch.zeros_like(scale) if symmetric else low + 8 * scale
    return Int4Groups(torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8, generator=g), scale, zero)


def _groups(kind: str, out_f: int, in_f: int, seed: int, half: bool = False) -> Int4Groups | Int8Groups:
    if kind == "int8":
        return _int8_groups(out_f, in_f, seed, half)
    return _int4_groups(out_f, in_f, seed, symmetric=kind == "q4_0", half=half)


def _int8_groups(out_f: int, in_f: int, seed: int, half: bool = False) -> Int8Groups:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(out_f, in_f // 32, generator=g) * 0.01
    return Int8Groups(torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8, generator=g),
                      scale.half().float() if half else scale)


def _int8_activation_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per group of 32 (unit max|x|/127, ties to even), times the exact weight."""
    rows, in_f = x.shape
    xg = x.float().view(rows, in_f // 32, 32)
    unit = xg.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(unit > 0, torch.round(xg / torch.where(unit > 0, unit, 1)), 0)
    return (codes * unit).view(rows, in_f) @ weight.T


def _int8_groups_of_16(out_f: int, in_f: int, seed: int, bits: int = 6) -> Int8Groups:
    """Q6_K-like: 6-bit codes held as q - 32 (or wider ones), a scale per 16 weights (d times an int8)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.randint(-128, 128, (out_f, in_f // 16), generator=g).float() * 0.0003
    top = 2 ** (bits - 1)
    return Int8Groups(torch.randint(1 - top, top, (out_f, in_f), dtype=torch.int8, generator=g), scale)


def _five_bit_groups(out_f: int, in_f: int, seed: int, half: bool = False) -> Int8Groups:
    """Q5_0-like: codes q in -16..15, w = scale * q, one scale per 32 weights."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-16, 16, (out_f, in_f), dtype=torch.int8, generator=g)
    scale = torch.rand(out_f, in_f // 32, generator=g) * 0.01 + 0.001
    return Int8Groups(q, scale.half().float() if half else scale)


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("out_f", [16, 40, 300])
@pytest.mark.parametrize("bits", [6, 8])
def test_scales_per_16_codes_take_the_integer_kernel_where_it_serves_them(rows, out_f, bits):
    """Q6_K's groups of 16 (two scales per group of 32 of x): the AVX2 and portable builds run
    them on int8_act_gemm, to the written-out arithmetic, 6-bit codes as 0-63 with zero point 32
    (the AVX2 tiles then multiply without the sign trick; the row of largest codes against the
    largest x checks their int16 sums) and wider ones with zero point 128; the AVX512-VNNI tiles
    sum and scale each half of a group on its own."""
    assert cpu_kernels.load()
    in_f = 96
    groups = _int8_groups_of_16(out_f, in_f, seed=rows * 7 + out_f, bits=bits)
    groups.q[0] = 2 ** (bits - 1) - 1
    lin = _linear(groups)
    assert lin.add_int8_activation_gemm_() and lin.act_scale.shape[-1] == 32
    assert lin.int8_act_zero_point == (32 if bits == 6 else 128)
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 2.0  # codes of 127
    expected = _int8_activation_product(x, groups.dequantize())
    torch.testing.assert_close(lin(x), expected, atol=1e-4, rtol=1e-4)
    fused = Int8Groups.cat([groups, _int8_groups(32, in_f, seed=1)])  # a Q8_0 part joins at groups of 16
    assert fused.group_size == 16
    torch.testing.assert_close(fused.dequantize()[out_f:], _int8_groups(32, in_f, seed=1).dequantize())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 100])
@pytest.mark.parametrize("out_f", [16, 40, 300])
@pytest.mark.parametrize("half", [False, True])
def test_five_bit_codes_are_packed_as_nibbles_and_fifth_bits(rows, out_f, half):
    """Q5_0's codes (q in -16..15, w = scale * q): every build stores them as nibbles plus a
    plane of fifth bits (320 bytes per block and group, zero point 16) and gives the
    written-out arithmetic, also where the largest codes meet the largest x (the AVX2 tiles'
    int16 sums are widened every two steps). A call of one row (the fifth bits ORed on in the
    tile) gives each row of a larger call (its codes unpacked to bytes first) bit for bit."""
    assert cpu_kernels.load()
    in_f = 128
    groups = _five_bit_groups(out_f, in_f, seed=rows * 31 + out_f, half=half)
    groups.q[0], groups.q[-1, :64] = 15, -16  # a row of the largest codes, and the smallest
    lin = _linear(groups)
    assert lin.add_int8_activation_gemm_() and lin.int8_act_out_features == out_f
    assert lin.act_codes.shape[-1] == 320 and lin.int8_act_zero_point == 16
    assert lin.act_scale.dtype == (torch.float16 if half else torch.float32)
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows))
    x[0, :64] = 3.0  # every code 127 in two groups: against the row of 15s, the largest sums
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (rows, out_f)
    torch.testing.assert_close(y, _int8_activation_product(x, groups.dequantize()), atol=1e-4, rtol=1e-4)
    for r in range(rows):
        assert torch.equal(lin(x[r:r + 1]), y[r:r + 1])
    y16 = lin(x.bfloat16())
    expected16 = _int8_activation_product(x.bfloat16(), groups.dequantize())
    torch.testing.assert_close(y16.float(), expected16, atol=expected16.abs().max().item() / 128, rtol=2**-8)
    # a down projection's input, rounded in the kernel
    gate_up = torch.randn(rows, 2 * in_f, generator=torch.Generator().manual_seed(rows + 1)) * 3
    assert torch.equal(lin.forward_gated(gate_up), lin(torch.ops.gemel.silu_and_mul(gate_up)))


def _linear(groups: Int4Groups | Int8Groups) -> Linear:
    lin = Linear(groups.dequantize().bfloat16())
    if isinstance(groups, Int4Groups):
        lin.checkpoint_int4 = lambda: groups
    else:
        lin.checkpoint_int8 = lambda: groups
    return lin


@pytest.mark.parametrize("kind", ["int4", "q4_0", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 7, 33, 100])  # 100: past the per-thread scratch
@pytest.mark.parametrize("out_f", [40, 300])
@pytest.mark.parametrize("half", [False, True])
def test_int8_activation_gemm_equals_the_arithmetic_written_out(kind, rows, out_f, half):
    """Every row count (tails of the 4-row tiles), output sizes off the 16-row blocks and the
    3-block tiles, 4-bit (w = scale * q + low; Q4_0's w = scale * (q - 8)) and 8-bit (w = scale
    * q) groups; float32 x gives float32 out to within summation order, and an all-zero group
    of x stays finite. Q4_0 and 8-bit groups take the integer zero point instead of low.
    Scales that float16 holds exactly (a GGUF file's) are stored as float16."""
    assert cpu_kernels.load()
    in_f = 96
    groups = _groups(kind, out_f, in_f, seed=rows + out_f, half=half)
    lin = _linear(groups)
    assert lin.add_int8_activation_gemm_() and lin.int8_act_out_features == out_f
    assert lin.act_codes.shape[-1] == (512 if kind == "int8" else 256)  # 4-bit codes two a byte
    assert lin.int8_act_zero_point == {"int4": 0, "q4_0": 8, "int8": 128}[kind]
    assert lin.act_low.numel() == (0 if lin.int8_act_zero_point else lin.act_scale.numel())
    assert lin.act_scale.dtype == lin.act_low.dtype == (torch.float16 if half else torch.float32)
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows))
    x[0, 32:64] = 0.0
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (rows, out_f) and torch.isfinite(y).all()
    expected = _int8_activation_product(x, groups.dequantize())
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
    # Rounding x is the only loss, and a visible one: this is not the dense product.
    assert (y - x @ groups.dequantize().T).abs().max() > 1e-3
    y16 = lin(x.bfloat16())
    expected16 = _int8_activation_product(x.bfloat16(), groups.dequantize())
    assert y16.dtype == torch.bfloat16  # rounded once, at the end: within bf16's unit of the largest output
    torch.testing.assert_close(y16.float(), expected16, atol=expected16.abs().max().item() / 128, rtol=2**-8)


@pytest.mark.parametrize("rows", [1, 4, 6])
def test_8_bit_codes_at_full_scale(rows):
    """8-bit weights at full scale (|q| = 127) with x's signs matched to them, so that every
    product adds to the same side (the largest sums any tile makes: in the AVX2 tiles' int16
    pairs 2 x 127 x 127), and groups of x whose |x| meeting in one int16 lane of two steps
    (codes 8p, 8p+1, 8p+4, 8p+5 or 8p+2, 8p+3, 8p+6, 8p+7) add up to 258 or 259, either side of
    what two steps' products could add up to in int16 (127 x 258 = 32,766); rows mix both.
    Every output is the arithmetic written out (a sum wrapped in int16 would be off by 65,536
    units), and the argmax too."""
    assert cpu_kernels.load()
    in_f, out_f = 160, 40
    g = torch.Generator().manual_seed(rows)
    signs = torch.where(torch.rand(in_f, generator=g) < 0.5, -1, 1)
    q = (127 * signs).repeat(out_f, 1)
    q[1::2] = -q[1::2]  # half the outputs sum to the most negative side
    groups = Int8Groups(q.to(torch.int8), torch.full((out_f, in_f // 32), 0.01))
    lin = _linear(groups)
    assert lin.add_int8_activation_gemm_()

    def group(lanes: tuple[int, int, int, int], odd: bool) -> torch.Tensor:
        """Codes 0-7 of a group putting `lanes` in one lane of steps 0 and 1, then zeros, and
        127 at code 31 (the group's largest, so its unit is 1 and x's codes are x)."""
        codes = torch.zeros(32)
        first = 2 if odd else 0
        codes[first], codes[first + 1], codes[first + 4], codes[first + 5] = (float(v) for v in lanes)
        codes[31] = 127.0
        return codes

    patterns = [group((127, 127, 2, 2), False), group((127, 127, 2, 3), False), group((127, 2, 127, 2), True),
                group((100, 100, 30, 29), True), group((127, 127, 3, 2), True)]
    x = torch.stack([torch.cat([patterns[(r + k) % len(patterns)] for k in range(in_f // 32)]) for r in range(rows)])
    x = x * signs
    y = lin(x)
    expected = _int8_activation_product(x, groups.dequantize())
    torch.testing.assert_close(y, expected, atol=1e-3, rtol=1e-5)
    assert expected.abs().max() > 400  # the sums do reach the limit
    assert torch.equal(lin.argmax(x), y.argmax(-1))


@pytest.mark.parametrize("kind", ["int4", "q4_0", "int8", "five", "sixteen"])
def test_calls_of_many_rows_of_long_inputs(kind):
    """75 rows of 4,096 inputs (past the per-thread scratch, off the 4-row tiles) in each code
    layout (4-bit with and without a zero point, 8-bit, Q5_0's 5-bit, Q6_K's scales per 16):
    every row gets the written-out arithmetic, and its result does not depend on the other
    rows of the call (any 32 of them as a call of their own: the same values, bit for bit)."""
    assert cpu_kernels.load()
    rows, out_f, in_f = 75, 40, 4096
    if kind == "five":
        groups = _five_bit_groups(out_f, in_f, seed=5)
    elif kind == "sixteen":
        groups = _int8_groups_of_16(out_f, in_f, seed=16)
    else:
        groups = _groups(kind, out_f, in_f, seed=rows)
    lin = _linear(groups)
    assert lin.add_int8_activation_gemm_()
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(1))
    y = lin(x)
    expected = _int8_activation_product(x, groups.dequantize())
    torch.testing.assert_close(y, expected, atol=1e-3, rtol=1e-4)
    for first in (0, 32, 43):
        assert torch.equal(lin(x[first:first + 32]), y[first:first + 32])


def test_weight_only_kernels_keep_the_small_calls():
    """With weight_quant=checkpoint, calls of up to packed_max_rows rows keep the weight-only
    kernel (x not rounded to int8); larger ones take the int8-activation GEMM. The dense
    weight is let go: no call uses it any more."""
    assert cpu_kernels.load()
    groups = _int4_groups(64, 128, seed=1)
    model = torch.nn.Sequential(_linear(groups))
    reference = _linear(groups)
    reference.quantize_("checkpoint", packed_max_rows=4)
    assert quantize_model_(model, "checkpoint", packed_max_rows=4, int8_activations=True) == 1
    lin = model[0]
    assert lin.weight is None and lin.checkpoint_int4 is None and lin.int8_act_out_features == 64
    small, large = torch.randn(4, 128), torch.randn(5, 128)
    torch.testing.assert_close(lin(small), reference(small), atol=0, rtol=0)
    torch.testing.assert_close(lin(large), _int8_activation_product(large, groups.dequantize()), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prepacked", [False, True])
def test_calls_above_the_row_limit_take_the_bf16_gemm(prepacked):
    """With int8_act_max_rows (the default on CPUs with AMX), larger calls, plain and gated,
    take the dense bf16 product (oneDNN's, once prepacked) and smaller ones int8_act_gemm; the
    dense weight stays for them."""
    assert cpu_kernels.load()
    groups = _int4_groups(64, 128, seed=2)
    model = torch.nn.Sequential(_linear(groups))
    quantize_model_(model, "checkpoint", packed_max_rows=4, int8_activations=True, int8_act_max_rows=8)
    lin = model[0]
    assert lin.weight is not None and lin.int8_act_max_rows == 8
    dense = groups.dequantize().bfloat16()
    if prepacked:
        if not kernel_plan.bf16_gemm_supported():
            assert not lin.prepack_() and lin.weight is not None  # PyTorch's own bf16 kernels serve
            pytest.skip("oneDNN has no bf16 GEMM on this CPU (AVX2 only): nothing to prepack")
        assert lin.prepack_() and lin.weight is None

    def dense_product(x: torch.Tensor) -> torch.Tensor:
        if prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, lin.onednn_weight, None, "none", [], "")
        return torch.nn.functional.linear(x, dense)

    g = torch.Generator().manual_seed(0)
    at_limit, above = torch.randn(8, 128, generator=g).bfloat16(), torch.randn(9, 128, generator=g).bfloat16()
    int8_product = torch.ops.gemel.int8_act_gemm(at_limit, lin.act_codes, lin.act_scale, lin.act_low, 64, False,
                                                lin.int8_act_zero_point)
    assert torch.equal(lin(at_limit), int8_product)
    assert not torch.equal(lin(at_limit), dense_product(at_limit))
    assert torch.equal(lin(above), dense_product(above))
    gate_up = torch.randn(9, 256, generator=g).bfloat16()
    assert torch.equal(lin.forward_gated(gate_up), dense_product(torch.ops.gemel.silu_and_mul(gate_up)))
    # both are the same weights: the two products differ only by x's rounding
    expected = _int8_activation_product(at_limit, groups.dequantize())
    torch.testing.assert_close(int8_product.float(), expected, atol=expected.abs().max().item() / 64, rtol=0)
    torch.testing.assert_close(dense_product(above).float(), above.float() @ dense.float().T, atol=0.1, rtol=2**-7)


@pytest.mark.parametrize("kind", ["int4", "q4_0", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_input_equals_silu_and_mul_first(kind, dtype):
    """forward_gated computes silu(gate) * up while rounding x: the same result, bit for bit,
    as the silu_and_mul op followed by the projection; small calls keep the weight-only kernel."""
    assert cpu_kernels.load()
    groups = _groups(kind, 80, 64, seed=5)
    model = torch.nn.Sequential(_linear(groups))
    quantize_model_(model, "checkpoint", packed_max_rows=4, int8_activations=True)
    lin = model[0]
    for rows in (3, 33):
        gate_up = (torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
        expected = lin(torch.ops.gemel.silu_and_mul(gate_up))
        assert torch.equal(lin.forward_gated(gate_up), expected)
    # and it is the gated product: not the projection of the gate alone
    assert not torch.equal(lin.forward_gated(gate_up), lin(gate_up[:, :64]))


@pytest.mark.parametrize("kind", ["int4", "q4_0", "int8", "five", "sixteen"])
@pytest.mark.parametrize("rows", [1, 5, 70])  # 70: past the per-thread scratch
@pytest.mark.parametrize("out_f", [40, 2070])  # 2070: three chunks of 1,024 outputs, the last off the blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_without_the_outputs_is_the_argmax_of_the_outputs(kind, rows, out_f, dtype):
    """Greedy sampling's head: Linear.argmax (int8_act_gemm_argmax, the outputs a chunk at a
    time, never all written) gives torch.argmax of what the projection returns, in x's dtype,
    for every code layout; ties go to the first index, also across chunks, and so does NaN."""
    assert cpu_kernels.load()
    in_f = 64
    if kind == "five":
        groups = _five_bit_groups(out_f, in_f, seed=rows + out_f)
    elif kind == "sixteen":
        groups = _int8_groups_of_16(out_f, in_f, seed=rows + out_f)
    else:
        groups = _groups(kind, out_f, in_f, seed=rows + out_f)
    lin = _linear(groups)
    assert lin.add_int8_activation_gemm_()
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows)).to(dtype)
    tokens = lin.argmax(x)
    assert tokens is not None and tokens.dtype == torch.int64 and tokens.shape == (rows,)
    assert torch.equal(tokens, lin(x).argmax(-1))
    if kind != "int8":
        return
    # The same largest row at several places, one of them in a later chunk: the first wins.
    places = [3, 17, out_f - 1] if out_f < 1024 else [1030, 1500, 2069]
    groups.q[places] = 127
    groups.scale[places] = 1.0
    tied = _linear(groups)
    assert tied.add_int8_activation_gemm_()
    positive = x.abs() + 0.5
    assert torch.equal(tied.argmax(positive), torch.full((rows,), places[0]))
    assert torch.equal(tied.argmax(positive), tied(positive).argmax(-1))
    # A NaN output (a NaN scale) outranks everything, the first of them.
    groups.scale[[places[1], places[2]], 0] = float("nan")
    poisoned = _linear(groups)
    assert poisoned.add_int8_activation_gemm_()
    assert torch.equal(poisoned.argmax(positive), torch.full((rows,), places[1]))


def test_argmax_is_left_to_the_caller_where_the_projection_is_not_int8_act_gemm():
    """A projection without the checkpoint's groups (or with a bias) has no fused argmax."""
    plain = Linear(torch.randn(32, 64).bfloat16())
    assert plain.argmax(torch.randn(2, 64)) is None


def test_projections_without_checkpoint_groups_stay_dense():
    plain = Linear(torch.randn(32, 64).bfloat16())
    model = torch.nn.Sequential(plain)
    quantize_model_(model, "none", packed_max_rows=4, int8_activations=True)
    assert plain.int8_act_out_features == 0 and plain.weight is not None


def test_compiled_graph_calls_the_kernel():
    """torch.compile traces the op through its registered shape function and runs the kernel."""
    assert cpu_kernels.load()
    groups = _int8_groups(48, 64, seed=3)
    lin = _linear(groups)
    lin.add_int8_activation_gemm_()
    x = torch.randn(9, 64)
    compiled = torch.compile(lin, dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(x), lin(x), atol=1e-5, rtol=1e-5)


def test_benchmark_configurations_load():
    """The configuration files that docs/benchmarks.md runs are valid gemel configurations."""
    from pathlib import Path

    from gemel.config import load_config

    files = sorted((Path(__file__).parents[2] / "bench" / "configs").glob("*.yaml"))
    assert len(files) >= 2
    for path in files:
        config = load_config(str(path))
        assert config.engine.num_threads == 2 and config.engine.int8_activations, path


class _TiedModel(torch.nn.Module):
    """A model's embedding and the tied LM head that shares its table, as the model files build them."""

    def __init__(self, groups: Int4Groups | Int8Groups, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = torch.nn.Parameter(groups.dequantize().to(dtype), requires_grad=False)
        self.lm_head = Linear(self.embed_tokens)
        self.lm_head.tied_embedding = True
        self.lm_head.checkpoint_int8 = (lambda: groups) if isinstance(groups, Int8Groups) else None
        self.lm_head.checkpoint_int4 = (lambda: groups) if isinstance(groups, Int4Groups) else None


@pytest.mark.skipif(not cpu_kernels.load(), reason="needs the C++ kernels")
@pytest.mark.parametrize("vocab", [16, 37, 300])  # 37: rows past the last whole block of 16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_head_on_8_bit_codes_serves_the_token_lookups_exactly(vocab, dtype):
    groups = _int8_groups(vocab, 96, seed=vocab, half=True)  # Q8_0: float16 scales
    model = _TiedModel(groups, dtype)
    table = model.embed_tokens.detach().clone()
    kept = _TiedModel(groups, dtype)  # a head that keeps its dense weight for larger calls
    quantize_model_(kept, "none", 0, int8_activations=True, int8_act_max_rows=64)
    assert not share_tied_table_(kept) and kept.embed_tokens is not None

    quantize_model_(model, "none", 0, int8_activations=True)  # every call on int8_act_gemm
    assert model.lm_head.weight is None and share_tied_table_(model) and model.embed_tokens is None
    ids = torch.tensor([[0, vocab - 1, 5 % vocab], [vocab // 2, 1, 0]])
    rows = model.lm_head.embedding_rows(ids)
    assert rows.dtype == dtype and torch.equal(rows, table[ids])
    assert torch.equal(model.lm_head.embedding_rows(torch.arange(vocab)), table)


@pytest.mark.skipif(not cpu_kernels.load(), reason="needs the C++ kernels")
@pytest.mark.parametrize("half", [True, False])
def test_token_lookups_on_8_bit_codes_refuse_rows_past_the_vocabulary(half):
    groups = _int8_groups(37, 64, seed=5, half=half)
    model = _TiedModel(groups, torch.float32)
    table = model.embed_tokens.detach().clone()
    quantize_model_(model, "none", 0, int8_activations=True)
    assert share_tied_table_(model)
    ids = torch.tensor([36, 0, 17], dtype=torch.int32)
    assert torch.equal(model.lm_head.embedding_rows(ids), table[ids.long()])
    for bad in (37, 47, -1):  # 37-47: the zero rows that pad the last block of 16
        with pytest.raises(RuntimeError, match="out of range"):
            model.lm_head.embedding_rows(torch.tensor([0, bad]))


@pytest.mark.skipif(not cpu_kernels.load(), reason="needs the C++ kernels")
def test_a_tied_head_on_4_bit_codes_keeps_the_table():
    model = _TiedModel(_int4_groups(40, 64, seed=3), torch.float32)
    quantize_model_(model, "none", 0, int8_activations=True)
    assert model.lm_head.weight is None and not share_tied_table_(model) and model.embed_tokens is not None


@pytest.mark.parametrize("kind", ["int4", "q4_0", "int8", "five", "sixteen"])
def test_asking_ahead_for_the_weights_changes_no_output(kind):
    """The AVX2 tiles' switch for asking ahead for streamed weights (set by the engine from
    timings, gemel/layers/stream_prefetch.py) moves only the time: calls of 1, 2 and 5 rows (a
    trailing 1-row tile), long enough inputs that the asking reaches past the first groups,
    give the same values bit for bit with each kind of codes asked for or not."""
    assert cpu_kernels.load()
    out_f, in_f = 40, 4096
    if kind == "five":
        groups = _five_bit_groups(out_f, in_f, seed=3)
    elif kind == "sixteen":
        groups = _int8_groups_of_16(out_f, in_f, seed=3)
    else:
        groups = _groups(kind, out_f, in_f, seed=3)
    lin = _linear(groups)
    assert lin.add_int8_activation_gemm_()
    x = torch.randn(5, in_f, generator=torch.Generator().manual_seed(3))
    before = torch.ops.gemel.set_stream_prefetch(3)
    try:
        want = {rows: lin(x[:rows]) for rows in (1, 2, 5)}
        torch.testing.assert_close(want[5], _int8_activation_product(x, groups.dequantize()), atol=1e-3, rtol=1e-4)
        for kinds in (0, 1, 2):
            assert torch.ops.gemel.set_stream_prefetch(kinds) in (3, 0, 1)
            assert torch.ops.gemel.set_stream_prefetch(-1) == kinds
            for rows, y in want.items():
                assert torch.equal(lin(x[:rows]), y)
    finally:
        torch.ops.gemel.set_stream_prefetch(before)


def test_the_asking_ahead_switch_refuses_other_kinds():
    assert cpu_kernels.load()
    for kinds in (4, 7, -2):
        with pytest.raises(RuntimeError, match="kinds is -1"):
            torch.ops.gemel.set_stream_prefetch(kinds)
    assert torch.ops.gemel.set_stream_prefetch(-1) in (0, 1, 2, 3)
