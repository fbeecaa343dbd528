"""One production implementation per operator: ``runtime=off`` (padded tensors), ``auto`` fallbacks and
the localizer (packed rows) run the same functions, and the ``off`` trace counts the calls that ran."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from mmdit_strict import MMDiT
from mmdit_strict.kernels import (
    Runtime,
    capture_trace,
    implementations,
    register,
    resolve,
)
from mmdit_strict.kernels.registry import KernelImpl
from mmdit_strict.model.layers import RMSNorm
from mmdit_strict.model.strict import capture_operators, inject_fault, strict_forward
from mmdit_strict.trajectories.localize import _sample_rows
from tests.harness import assert_bytes_equal
from tests.helpers import make_inputs

DTYPES = [torch.float32, torch.bfloat16]
LENS = (5, 9, 3)  # valid rows per sample; the padded layout holds max(LENS) rows per sample


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return MMDiT.from_pretrained(tiny_ckpt[0], runtime="off")


def _production(op: str, dtype: torch.dtype):
    impl, fell_back = resolve(op, "cpu", dtype, Runtime.OFF)
    assert impl.backend == "torch" and not impl.strict and not fell_back
    return impl.fn


def _padded(shape_tail: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(len(LENS), max(LENS), *shape_tail, generator=g)).to(dtype)


def _pack(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t[b, :n] for b, n in enumerate(LENS)])


def _vec(dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(len(LENS), dim, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rmsnorm_module_is_the_production_operator(dtype):
    """The RMSNorm the off path's modules hold and the qk_rmsnorm ``auto`` falls back to give the same bytes
    (they once differed in 530 of 2,048 BF16 elements: diffusers' cast points vs ATen's fused rms_norm)."""
    d = 64
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(d, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_((1.0 + 0.3 * torch.randn(d, generator=g)).to(dtype))
    x = (3.0 * torch.randn(32, d, generator=g)).to(dtype)
    with torch.no_grad():
        assert_bytes_equal(norm(x), _production("qk_rmsnorm", dtype)(x, norm.weight, seqlens=(32,), eps=1e-6),
                           f"layers.RMSNorm vs production qk_rmsnorm ({dtype})")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_padded_and_packed_layouts_give_the_same_rows(dtype):
    """Norm, modulation, gate and RoPE arithmetic is one function: a row's bytes do not depend on the layout."""
    D, H, hd = 32, 2, 8
    x = _padded((D,), dtype, 1)
    y = _padded((D,), dtype, 2)
    shift, scale, gate = _vec(D, dtype, 3), _vec(D, dtype, 4), _vec(D, dtype, 5)
    heads = _padded((H, hd), dtype, 6)
    gain = (1.0 + 0.2 * torch.randn(hd, generator=torch.Generator().manual_seed(7))).to(dtype)
    angles = torch.rand(len(LENS), max(LENS), hd // 2, generator=torch.Generator().manual_seed(8)) * 6.0
    cos, sin = torch.cos(angles), torch.sin(angles)

    cases = {
        "adaln_modulation": (
            lambda: _production("adaln_modulation", dtype)(x, shift, scale, seqlens=None, eps=1e-6),
            lambda: _production("adaln_modulation", dtype)(_pack(x), shift, scale, seqlens=LENS, eps=1e-6),
        ),
        "adaln_gate_residual": (
            lambda: _production("adaln_gate_residual", dtype)(x, y, gate, seqlens=None),
            lambda: _production("adaln_gate_residual", dtype)(_pack(x), _pack(y), gate, seqlens=LENS),
        ),
        "qk_rmsnorm": (
            lambda: _production("qk_rmsnorm", dtype)(heads, gain, seqlens=None, eps=1e-6),
            lambda: _production("qk_rmsnorm", dtype)(_pack(heads), gain, seqlens=LENS, eps=1e-6),
        ),
        "multi_axis_rope": (
            lambda: _production("multi_axis_rope", dtype)(heads, cos, sin),
            lambda: _production("multi_axis_rope", dtype)(_pack(heads), _pack(cos), _pack(sin)),
        ),
    }
    for op, (padded, packed) in cases.items():
        assert_bytes_equal(_pack(padded()), packed(), f"{op} ({dtype}): padded rows vs packed rows")


@contextlib.contextmanager
def _counting_production_kernels() -> Iterator[Counter]:
    """Re-register every production implementation wrapped in a call counter; restore the originals after."""
    calls: Counter = Counter()
    originals = [i for i in implementations() if i.backend == "torch"]

    def counted(impl: KernelImpl):
        def fn(*args, **kwargs):
            calls[impl.op] += 1
            return impl.fn(*args, **kwargs)

        return fn

    # one wrapper per (op, device): both dtypes share the registration
    for impl in originals:
        register(KernelImpl(**{**impl.__dict__, "fn": counted(impl)}))
    try:
        yield calls
    finally:
        for impl in originals:
            register(impl)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_off_trace_counts_the_calls_that_ran(model, tiny_ckpt, dtype):
    """Every production kernel call is counted by a wrapper around it; the trace must report those counts."""
    m = model if dtype is torch.float32 else MMDiT.from_pretrained(tiny_ckpt[0], runtime="off", dtype=dtype)
    inputs = make_inputs(2, (4, 6), [5, 9], pad_to=11, dtype=dtype)
    with _counting_production_kernels() as calls, capture_trace() as trace, torch.no_grad():
        m(**inputs)
    traced: Counter = Counter()
    for r in trace.records.values():
        assert r.actual_backend == "torch" and r.requested == "off" and not r.fallback, r
        assert r.dtype == {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
        traced[r.op] += r.calls
    assert sum(calls.values()) > 0, "the off forward ran no production operator"
    assert traced == calls, f"trace {dict(traced)} vs calls made {dict(calls)}"
    # the production forward runs every operator of the strict graph (auto on CPU bf16: all fallbacks)
    with capture_trace() as auto_trace, torch.no_grad():
        m.set_runtime("auto")
        try:
            m(**inputs)
        finally:
            m.set_runtime("off")
    assert {r.op for r in auto_trace.records.values()} == set(calls)


def test_off_capture_has_the_strict_keys_and_lines_up(model):
    """The production forward is captured under the strict graph's keys, in the same order, and its padded
    captures unpad (as the localizer does) to the strict side's row shapes."""
    inputs = make_inputs(3, (4, 4), [5, 9, 2], pad_to=12)
    v = model.validate_inputs(**{k: inputs[k] for k in (
        "hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "img_shapes")})
    with torch.no_grad(), capture_operators() as off:
        model.production_forward(v)
    from mmdit_strict.kernels.runtime import runtime_mode

    with torch.no_grad(), runtime_mode(Runtime.STRICT), capture_operators() as strict:
        strict_forward(model, v)
    assert list(off) == list(strict)
    T = 16
    for pos in range(3):
        a = _sample_rows(off, pos, [T] * 3, v.txt_lens, padded=True)
        b = _sample_rows(strict, pos, [T] * 3, v.txt_lens, padded=False)
        for key in a:
            assert a[key].shape == b[key].shape, (key, a[key].shape, b[key].shape)
    # the input projection is one GEMM on the same rows here: byte-equal after unpadding
    assert_bytes_equal(_sample_rows(off, 1, [T] * 3, v.txt_lens, True)["img_in.latent_proj_gemm"],
                       _sample_rows(strict, 1, [T] * 3, v.txt_lens, False)["img_in.latent_proj_gemm"], "img_in rows")


def test_fault_lands_in_the_production_forward(model):
    """``inject_fault`` reaches the off path's operator of that name (the localizer's off-side replay relies on it)."""
    inputs = make_inputs(2, (4, 4), [5, 9], pad_to=10)
    model.set_runtime("off")
    key = "block1.img.mlp_down_gemm"
    with torch.no_grad(), capture_operators() as clean:
        base = model(**inputs).sample
    with torch.no_grad(), capture_operators() as hit, inject_fault(key):
        bumped = model(**inputs).sample
    assert not torch.equal(base, bumped)
    diff = (clean[key] != hit[key]).reshape(-1)
    assert diff[0] and int(diff.sum()) == 1, "exactly the first element of that operator's output is bumped"
    before = list(clean).index(key)
    for k in list(clean)[:before]:
        assert_bytes_equal(clean[k], hit[k], f"{k} runs before the fault")


def test_non_plain_linear_runs_as_its_module_and_is_still_traced(model):
    """A linear layer with a hook (or a PEFT wrapper) runs as its own module: the hook fires, the bytes equal
    the operator path's (both are one F.linear), and the call is recorded and captured as its operator."""
    inputs = make_inputs(2, (4, 4), [5, 9])
    model.set_runtime("off")
    with torch.no_grad(), capture_trace() as plain_trace:
        plain = model(**inputs).sample
    seen = []
    handle = model.img_in.register_forward_hook(lambda _m, _a, out: seen.append(out.shape))
    try:
        with torch.no_grad(), capture_trace() as hooked_trace, capture_operators() as cap:
            hooked = model(**inputs).sample
    finally:
        handle.remove()
    assert seen == [torch.Size([2, 16, model.config.hidden_size])], "the module (and so its hook) must run"
    assert "img_in.latent_proj_gemm" in cap
    assert_bytes_equal(hooked, plain, "hooked img_in vs operator img_in")

    def calls(trace):
        return Counter({r.op: r.calls for r in trace.records.values()})

    assert calls(hooked_trace) == calls(plain_trace)
    kernels = {r.kernel["kernel"] for r in hooked_trace.records.values() if r.op == "latent_proj_gemm"}
    assert kernels and kernels <= {"aten_gemm", "module_Linear"}, kernels
