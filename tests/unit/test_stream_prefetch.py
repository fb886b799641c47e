"""Asking ahead for a decode step's weights, decided by timing on this CPU
(gemel/layers/stream_prefetch.py): where it runs, what it sets, and where it stays out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gemel.layers import cpu_kernels, kernel_plan, stream_prefetch
from gemel.layers.linear import Linear
from gemel.models.weights import Int4Groups, Int8Groups

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="needs the C++ kernels")


@pytest.fixture
def kinds_restored():
    before = stream_prefetch.current_kinds()
    yield
    stream_prefetch.set_kinds(before)


def _model() -> nn.Module:
    """Two projections on 4-bit codes and an LM-head-like one on 8-bit codes, packed for
    int8_act_gemm as the AVX2 plan packs a checkpoint's groups."""
    g = torch.Generator().manual_seed(0)
    layers = []
    for out_f, in_f, bits in ((96, 64, 4), (64, 96, 4), (200, 64, 8)):
        scale = torch.rand(out_f, in_f // 32, generator=g) * 0.01 + 0.001
        if bits == 4:
            groups = Int4Groups(torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8, generator=g), scale, 8 * scale)
        else:
            groups = Int8Groups(torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8, generator=g), scale)
        lin = Linear(groups.dequantize())
        if bits == 4:
            lin.checkpoint_int4 = lambda groups=groups: groups
        else:
            lin.checkpoint_int8 = lambda groups=groups: groups
        assert lin.add_int8_activation_gemm_()
        lin.weight = None  # as the every-call plan leaves it: the codes alone
        layers.append(lin)
    return nn.Sequential(*layers)


def _plan(isa: str = "avx2") -> kernel_plan.KernelPlan:
    plan, _ = kernel_plan.plan_engine(device=torch.device("cpu"), dtype=torch.float32, dtype_requested="auto",
                                      weight_quant="auto", cpu_isa=isa)
    return plan


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_the_faster_way_is_set_for_each_kind_of_codes(kinds_restored, isa):
    """On the AVX2 tiles and on the AVX-512 (VNNI) ones, where the CPU and the loaded build have them."""
    if kernel_plan.isa_rank(kernel_plan.resolve_isa()) < kernel_plan.isa_rank(isa):
        pytest.skip(f"needs a CPU (and kernels) with {isa}")
    plan = _plan(isa)
    assert stream_prefetch.applies(plan)
    assert plan.isa == isa and plan.int8_activations
    choice = stream_prefetch.tune(_model(), plan, min_bytes=0)
    assert choice is not None and choice.kinds == stream_prefetch.current_kinds()
    assert set(choice.pass_ms) == {"8-bit codes", "4-/5-bit codes"}
    for asking, not_asking in choice.pass_ms.values():
        assert asking > 0 and not_asking > 0
    text = choice.describe()
    assert "8-bit codes" in text and "4-/5-bit codes" in text and "ms asking" in text


def test_nothing_is_timed_off_the_integer_tiles_or_for_weights_the_caches_hold(kinds_restored):
    stream_prefetch.set_kinds(2)
    model = _model()
    portable = _plan("portable")
    assert not stream_prefetch.applies(portable)
    assert stream_prefetch.tune(model, portable, min_bytes=0) is None
    dense, _ = kernel_plan.plan_engine(device=torch.device("cpu"), dtype=torch.float32, dtype_requested="float32",
                                       weight_quant="none", cpu_isa="portable")
    assert not dense.int8_activations and not stream_prefetch.applies(dense)
    if kernel_plan.isa_rank(kernel_plan.resolve_isa()) >= kernel_plan.isa_rank("avx2"):
        assert stream_prefetch.tune(model, _plan("avx2")) is None  # a few KB: below MIN_STREAM_BYTES
    assert stream_prefetch.current_kinds() == 2


def test_code_kinds():
    assert stream_prefetch.code_kind(torch.empty(2, 3, 512, dtype=torch.uint8)) == stream_prefetch.BYTE_CODES
    for width in (256, 320):
        assert stream_prefetch.code_kind(torch.empty(2, 3, width, dtype=torch.uint8)) == stream_prefetch.NIBBLE_CODES


def test_each_kind_is_timed_over_its_own_weights_in_a_whole_pass(kinds_restored, monkeypatch):
    """A kind's time counts only the calls on its codes, yet every projection runs in each pass
    (as a decode step reads them): a slow 8-bit layer does not enter the 4-bit kind's time.
    The clock the tuner reads is a stand-in that moves 20 ms only while the 8-bit head runs, so
    what is checked is which calls each kind's time covers, not how fast this machine is."""
    if kernel_plan.isa_rank(kernel_plan.resolve_isa()) < kernel_plan.isa_rank("avx2"):
        pytest.skip("needs a CPU (and kernels) with avx2")
    model = _model()
    head = model[2]
    calls = {"head": 0, "others": 0}
    real_forward = Linear.forward
    clock = {"s": 0.0}

    class StandInTime:
        @staticmethod
        def perf_counter() -> float:
            clock["s"] += 1e-6  # each reading a microsecond later
            return clock["s"]

    def forward(self, x):
        if self is head:
            calls["head"] += 1
            clock["s"] += 0.02
        else:
            calls["others"] += 1
        return real_forward(self, x)

    monkeypatch.setattr(Linear, "forward", forward)
    monkeypatch.setattr(stream_prefetch, "time", StandInTime)
    choice = stream_prefetch.tune(model, _plan("avx2"), min_bytes=0)
    assert choice is not None
    passes = 1 + 2 * 2 * stream_prefetch.ROUNDS  # a warm-up, then each kind both ways
    assert calls == {"head": passes, "others": 2 * passes}
    eight_bit, nibbles = choice.pass_ms["8-bit codes"], choice.pass_ms["4-/5-bit codes"]
    # The head's one call: its 20 ms and the microsecond between its two readings.
    assert eight_bit == pytest.approx((20.001, 20.001), abs=1e-6)
    # The two 4-bit calls: a microsecond each, the head's 20 ms outside both.
    assert nibbles == pytest.approx((0.002, 0.002), abs=1e-6)
