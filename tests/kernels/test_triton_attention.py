"""Strict joint attention (Triton): FP32 through the interpreter on the CPU (CI), BF16 and FP32 on CUDA.

Mode: without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` for the whole session before any
kernel module is imported; the interpreter tests run tiny odd shapes (2 heads × 16, tiles of 16 rows, lengths that divide no tile, empty
text segments). With CUDA the ``@pytest.mark.gpu`` tests run 24 heads × 128 in bf16 and fp32 at
77 + 6889 tokens through ``mmdit_strict.bench.attention`` (``python -m pytest -m gpu
tests/kernels/test_triton_attention.py``). Tolerances: ``tolerances.yaml`` ``attention.<check>.<dtype>``
(``atol_max``: a fraction of max|ref|, :func:`mmdit_strict.bench.attention.attention_tolerance`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

from mmdit_strict.kernels.triton import attention as A  # noqa: E402
from mmdit_strict.kernels.triton import attention_unfused as U  # noqa: E402

INTERPRET = A.interpreting()

from mmdit_strict.bench import attention as bench  # noqa: E402
from mmdit_strict.tolerances import tolerance  # noqa: E402
from mmdit_strict.reference import ops as ref_ops  # noqa: E402
from tests.harness import BadCase, assert_bytes_equal, check_bad_inputs  # noqa: E402

interp = pytest.mark.skipif(not INTERPRET, reason="interpreter (CPU FP32) test; CUDA runs the gpu tests")
H, D = 2, 16
DEV = "cpu" if INTERPRET else "cuda"


def _sample(nt: int, ni: int, seed: int) -> tuple:
    s = bench.make_sample(nt, ni, heads=H, head_dim=D, dtype=torch.float32, seed=seed, device=DEV)
    return s, bench.make_grad(s, seed + 500)


def _run(batch: list[tuple]) -> list[tuple]:
    return bench.run_batch(A.joint_attention_fused, [b[0] for b in batch], [b[1] for b in batch])


@interp
def test_accuracy_vs_fp64_reference() -> None:
    """Forward and the six input gradients of a mixed batch (empty text, tails of every tile) vs FP64."""
    batch = [_sample(5, 20, 1), _sample(0, 33, 2), _sample(17, 9, 3), _sample(16, 16, 4)]
    outs = _run(batch)
    for (s, g), out in zip(batch, outs):
        sub = [t.detach().double().requires_grad_(True) for t in s]
        nt, ni = s[0].shape[0], s[3].shape[0]
        rt, ri = ref_ops.joint_attention(*sub, (nt,), (ni,))
        rg = torch.autograd.grad((rt, ri), sub, tuple(x.double() for x in g))
        pairs = [("fwd", out[0], rt), ("fwd", out[1], ri)]
        for i, name in enumerate(("dq", "dk", "dv")):
            pairs += [(name, out[2 + i], rg[i]), (name, out[5 + i], rg[3 + i])]
        for name, got, ref in pairs:
            if ref.numel() == 0:
                assert got.numel() == 0
                continue
            tol = bench.attention_tolerance(name, torch.float32, ref)
            ok, max_abs, _ = tol.check(got.reshape(ref.shape), ref)
            assert ok, f"{name} (text {nt}, image {ni}): max abs {max_abs:.3e} beyond {tol}"


@interp
def test_sample_alone_equals_batched_at_every_position() -> None:
    """Bytes of a probe's outputs and gradients alone == in batches of 2 and 3 at every position."""
    probe = _sample(7, 21, 10)
    neighbours = [_sample(0, 13, 11), _sample(17, 33, 12)]
    (alone,) = _run([probe])
    for B in (2, 3):
        others = neighbours[:B - 1]
        for pos in range(B):
            batch = others[:pos] + [probe] + others[pos:]
            assert_bytes_equal(_run(batch)[pos], alone, f"B={B} probe at position {pos}")


@interp
def test_nan_neighbours_are_never_read() -> None:
    """A probe beside neighbours whose rows are all NaN keeps its bytes (no program reads another sample)."""
    probe = _sample(9, 18, 20)
    (alone,) = _run([probe])
    nan = [(tuple(torch.full_like(t, float("nan")) for t in s), g) for s, g in (_sample(3, 17, 21), _sample(0, 5, 22))]
    assert_bytes_equal(_run([nan[0], probe, nan[1]])[1], alone, "probe between NaN neighbours")


@interp
@pytest.mark.parametrize("option", ["frozen", "direct+tma+stat_base"])
def test_tail_tiles_never_write_over_neighbour_rows(option: str) -> None:
    """Launch one sample's tiles only, into outputs prefilled with a sentinel: every other row keeps it
    (the frozen configuration, and with every load option on)."""
    cfg = A.config_for(D, torch.float32).replace(**LOAD_OPTIONS.get(option, {}))
    batch = [_sample(5, 19, 30), _sample(11, 7, 31), _sample(0, 23, 32)]
    packed, tseq, iseq = bench.pack([b[0] for b in batch])
    rows_t = [(sum(tseq[:b]), sum(tseq[:b + 1])) for b in range(3)]
    rows_i = [(sum(iseq[:b]), sum(iseq[:b + 1])) for b in range(3)]
    sentinel = 12345.0
    for b in range(3):
        out = (torch.full_like(packed[0], sentinel), torch.full_like(packed[3], sentinel),
               torch.full((sum(tseq) + sum(iseq), H), sentinel, device=DEV))
        o_t, o_i, lse = A.attention_fwd(*packed, tseq, iseq, cfg, out=out, only_sample=b)
        gout = tuple(torch.full_like(t, sentinel) for t in packed)
        do_t, do_i = torch.randn_like(o_t), torch.randn_like(o_i)
        grads = A.attention_bwd(do_t, do_i, *packed, o_t, o_i, lse, tseq, iseq, cfg, out=gout, only_sample=b)
        for c in range(3):
            if c == b:
                continue
            for t in (o_t, grads[0], grads[1], grads[2]):
                assert bool((t[rows_t[c][0]:rows_t[c][1]] == sentinel).all()), f"sample {b} wrote text rows of sample {c}"
            for t in (o_i, grads[3], grads[4], grads[5]):
                assert bool((t[rows_i[c][0]:rows_i[c][1]] == sentinel).all()), f"sample {b} wrote image rows of sample {c}"
        t0, t1 = rows_t[b]
        i0, i1 = rows_i[b]
        assert not bool((o_t[t0:t1] == sentinel).any()) and not bool((o_i[i0:i1] == sentinel).any()), "own rows left unwritten"


# Load flags of AttentionConfig (off in the fp32 table, on in bf16 d = 128), each expected to read the same values as
# the pointer / select path
LOAD_OPTIONS = {
    "tma": {"fwd_tma": True},
    "direct": {"resident_direct": True},
    "stat_base": {"stat_base": True},
    "direct+tma": {"fwd_tma": True, "resident_direct": True},
    "direct+tma+stat_base": {"fwd_tma": True, "resident_direct": True, "stat_base": True},
}


def _run_cfg(batch: list[tuple], override: dict) -> list[tuple]:
    """attention_fwd + attention_bwd on the packed batch with the frozen config plus ``override``.

    Per sample: ``(o_txt, o_img, lse_txt, lse_img, dq_t, dk_t, dv_t, dq_i, dk_i, dv_i)``, the upstream
    gradient of each sample being its own.
    """
    packed, tseq, iseq = bench.pack([b[0] for b in batch])
    cfg = A.config_for(D, torch.float32).replace(**override)
    o_t, o_i, lse = A.attention_fwd(*packed, tseq, iseq, cfg)
    do_t = torch.cat([b[1][0] for b in batch]).view_as(o_t)
    do_i = torch.cat([b[1][1] for b in batch]).view_as(o_i)
    grads = A.attention_bwd(do_t, do_i, *packed, o_t, o_i, lse, tseq, iseq, cfg)
    mt, out, t0, i0 = sum(tseq), [], 0, 0
    for nt, ni in zip(tseq, iseq):
        t, i = slice(t0, t0 + nt), slice(i0, i0 + ni)
        out.append((o_t[t], o_i[i], lse[t], lse[mt + i0:mt + i0 + ni], *(g[t] for g in grads[:3]), *(g[i] for g in grads[3:])))
        t0, i0 = t0 + nt, i0 + ni
    return out


# The frozen path's outputs for the fixed batches below, computed once and shared by every load option held to
# them (the samples come from fixed seeds, so they are the same tensors each time; CI time).
_FROZEN: dict[str, list[tuple]] = {}


def _frozen(key: str, batch: list[tuple]) -> list[tuple]:
    if key not in _FROZEN:
        _FROZEN[key] = _run_cfg(batch, {})
    return _FROZEN[key]


@interp
@pytest.mark.parametrize("option", sorted(LOAD_OPTIONS))
def test_load_options_equal_frozen_bytes_on_partial_tiles(option: str) -> None:
    """Outputs, LSE and all six gradients under each load option == the frozen (pointer, select) path, sample by
    sample, in a batch whose segments end inside a tile (tails of 1..15 rows), start anywhere in the packed
    buffer, include an empty text and one exact tile."""
    batch = [_sample(7, 21, 90), _sample(0, 13, 91), _sample(17, 33, 92), _sample(16, 1, 93), _sample(5, 37, 94)]
    frozen = _frozen("partial tiles", batch)
    for b, (got, ref) in enumerate(zip(_run_cfg(batch, LOAD_OPTIONS[option]), frozen)):
        assert_bytes_equal(got, ref, f"{option} vs frozen, sample {b}")


@interp
@pytest.mark.parametrize("option", ["tma", "direct+tma+stat_base"])
def test_tma_probe_alone_equals_batched_at_every_position(option: str) -> None:
    """Under TMA loads a probe whose lengths divide no tile keeps its bytes (== the frozen path's, alone) in
    batches of 2 and 3 at every position beside neighbours of other lengths."""
    probe = _sample(7, 21, 95)
    neighbours = [_sample(0, 13, 96), _sample(17, 33, 97)]
    (alone,) = _frozen("tma probe", [probe])
    for B in (2, 3):
        for pos in range(B):
            batch = neighbours[:B - 1][:pos] + [probe] + neighbours[:B - 1][pos:]
            assert_bytes_equal(_run_cfg(batch, LOAD_OPTIONS[option])[pos], alone, f"{option}: B={B}, probe at {pos}")


@interp
@pytest.mark.parametrize("option", ["tma", "direct+tma+stat_base"])
def test_tma_boxes_never_carry_neighbour_rows(option: str) -> None:
    """A probe packed between NaN rows (neighbours longer than a tile on both sides, in both streams) keeps the
    frozen path's bytes: a descriptor box that carried a neighbour's row into a used position would turn
    the probe's outputs or gradients into NaN (a masked score still multiplies V's row; 0 · NaN = NaN)."""
    probe = _sample(9, 18, 98)
    (alone,) = _frozen("nan probe", [probe])
    nan = [(tuple(torch.full_like(t, float("nan")) for t in s), g) for s, g in (_sample(20, 37, 99), _sample(19, 40, 100))]
    assert_bytes_equal(_run_cfg([nan[0], probe, nan[1]], LOAD_OPTIONS[option])[1], alone, f"{option}: probe between NaN rows")


def test_config_must_be_an_attention_config() -> None:
    s, _ = _sample(3, 5, 51)
    packed, tseq, iseq = bench.pack([s])
    with pytest.raises(ValueError, match="AttentionConfig"):
        A.attention_fwd(*packed, tseq, iseq, {"fwd": (16, 16, 4, 2)})
    o_t, o_i, lse = A.attention_fwd(*packed, tseq, iseq)
    with pytest.raises(ValueError, match="AttentionConfig"):
        A.attention_bwd(o_t, o_i, *packed, o_t, o_i, lse, tseq, iseq, {"fwd": (16, 16, 4, 2)})
    with pytest.raises(TypeError):
        A.config_for(D, torch.float32).replace(fwd_loads="tma")


def test_config_table_is_frozen() -> None:
    """The table is a read-only mapping of frozen dataclasses, keyed by (head_dim, dtype)."""
    with pytest.raises(TypeError):
        A.CONFIGS[(D, torch.float32)] = A.config_for(D, torch.float32)  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        A.config_for(D, torch.float32).fwd_tma = True  # type: ignore[misc]
    assert all(isinstance(c, A.AttentionConfig) for c in A.CONFIGS.values())
    assert {(d, dt) for d, dt in A.CONFIGS} == {(d, dt) for d in A.HEAD_DIMS for dt in (torch.float32, torch.bfloat16)}


def test_bench_candidates_name_known_options() -> None:
    """Every candidate override of the GPU bench makes a configuration the launcher accepts."""
    for dtype, part, override in bench.CANDIDATES:
        assert dtype in bench.DTYPES and part in ("fwd", "bwd", "both"), (dtype, part)
        cfg = A.config_for(bench.HEAD_DIM, bench.DTYPES[dtype]).replace(**override)
        for t in (cfg.fwd, cfg.dkdv, cfg.dq):
            assert all(isinstance(x, int) and x > 0 for x in dataclasses.astuple(t)), override
    assert bench._parse_override('{"resident_direct": true, "dkdv": [32, 128, 8, 3]}', "--override-bf16") == {
        "resident_direct": True, "dkdv": (32, 128, 8, 3)}
    with pytest.raises(ValueError, match="JSON object"):
        bench._parse_override("[32, 128]", "--override-bf16")



@interp
@pytest.mark.extended  # the GPU bench's plumbing, not the product kernels: the device suite runs it
def test_bench_candidates_and_overrides_through_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU bench's candidate rows (bytes vs frozen) and a qualification with an override, shrunk to
    interpreter sizes (2 heads × 16, FP32; timing stubbed): the plumbing the next GPU call relies on (~8 s)."""
    for name, value in (("DEVICE", DEV), ("HEADS", H), ("HEAD_DIM", D), ("IMAGES", (37,)), ("TEXTS", {1: (5,)}),
                        ("PROBE_FP32", (7, 21)), ("NEIGHBOURS_FP32", ((0, 13), (17, 33)))):
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench, "_bench", lambda fn: (fn(), {"ms": 1.0, "ms_q20": 1.0, "ms_q80": 1.0})[1])
    monkeypatch.setattr(bench, "CANDIDATES", (("fp32", "both", {}), ("fp32", "both", LOAD_OPTIONS["direct+tma"]),
                                              ("fp32", "fwd", {"fwd": (16, 32, 4, 2)})))
    rows = bench.candidates(A)
    assert [(r["fwd_bytes_equal_frozen"], r["bwd_bytes_equal_frozen"]) for r in rows] == [(True, True), (True, True), (False, True)]
    assert rows[0]["config"] == "frozen" and "error" not in rows[1]
    cfg = A.config_for(D, torch.float32).replace(**LOAD_OPTIONS["direct+tma"])
    assert bench.invariance(A, "fp32", (2,), 1, cfg)["pass"]
    assert bench.accuracy_case(A, ref_ops, "fp32", 5, 37, cfg)["pass"]
    md = bench._markdown({"env": {}, "config_fp32": cfg, "overrides": {"fp32": LOAD_OPTIONS["direct+tma"]}, "candidates": rows})
    assert "Candidate under qualification" in md and "| fp32 | both | frozen |" in md


@interp
def test_repeated_backward_is_byte_equal() -> None:
    batch = [_sample(6, 17, 40), _sample(0, 21, 41)]
    first = _run(batch)
    for r in range(2):
        assert_bytes_equal(_run(batch), first, f"repeat {r + 1}")


@interp
def test_tile_table_is_anchored_per_segment() -> None:
    """Tiles start at each segment's own first row and never extend a segment's end (the kernels mask at it)."""
    tseq, iseq = (5, 0, 33), (20, 16, 1)
    table, n = A._tile_table(tseq, iseq, 16, torch.device("cpu"))
    rows = table.tolist()
    assert n == len(rows) == 1 + 2 + 1 + 3 + 1  # text 5 | image 20 | image 16 | text 33 | image 1
    ts = is_ = 0
    mt = sum(tseq)
    i = 0
    for nt, ni in zip(tseq, iseq):
        for stream, start, length, stat in ((0, ts, nt, ts), (1, is_, ni, mt + is_)):
            for off in range(0, length, 16):
                assert rows[i][:4] == [stream, start + off, start + length, stat + off]
                assert rows[i][4:] == [ts, nt, is_, ni, mt + is_]
                i += 1
        ts += nt
        is_ += ni
    again, _ = A._tile_table(tseq, iseq, 16, torch.device("cpu"))
    assert again is table  # cached: no host-to-device copy on a repeated call


def test_bad_inputs() -> None:
    s, _ = _sample(3, 5, 50)
    q_t, k_t, v_t, q_i, k_i, v_i = s
    ok = {"txt_seqlens": (3,), "img_seqlens": (5,)}
    cases = [
        BadCase("fp16", (q_t.half(), k_t.half(), v_t.half(), q_i.half(), k_i.half(), v_i.half()), ok, "fp32 or bf16"),
        BadCase("2-D q", (q_t.reshape(3, -1), k_t, v_t, q_i, k_i, v_i), ok, "shape (rows, H, d)"),
        BadCase("heads differ", (q_t[:, :1].contiguous(), k_t, v_t, q_i, k_i, v_i), ok, "q_txt of shape"),
        BadCase("dtype mix", (q_t.double(), k_t, v_t, q_i, k_i, v_i), ok, "dtype"),
        BadCase("non-contiguous", (q_t, k_t, v_t, q_i.transpose(0, 1).contiguous().transpose(0, 1), k_i, v_i), ok, "contiguous"),
        BadCase("k rows differ", (q_t, k_t[:2], v_t, q_i, k_i, v_i), ok, "one shape"),
        BadCase("seqlens sum", s, {"txt_seqlens": (2,), "img_seqlens": (5,)}, "sums to"),
        BadCase("seqlens count", s, {"txt_seqlens": (3, 0), "img_seqlens": (5,)}, "samples"),
        BadCase("negative", s, {"txt_seqlens": (4, -1), "img_seqlens": (5, 0)}, "non-negative"),
        BadCase("head_dim 24", tuple(torch.zeros(t.shape[0], H, 24, device=DEV) for t in s), ok, "head_dim"),
    ]
    if not INTERPRET:
        cases.append(BadCase("cpu tensors", tuple(t.cpu() for t in s), ok, "CUDA"))
    check_bad_inputs(lambda *a, **k: A.joint_attention_fused(*a, **k), cases)


def test_registered_strict_for_cuda() -> None:
    from mmdit_strict.kernels.registry import resolve
    from mmdit_strict.kernels.runtime import Runtime

    for dt in (torch.float32, torch.bfloat16):
        impl, fell_back = resolve("joint_attention_fused", "cuda", dt, Runtime.STRICT)
        assert impl.backend == "triton" and impl.strict and not fell_back
        assert impl.fn is A.joint_attention_fused or impl.fn.__name__ == "joint_attention_fused"


# ------------------------------------------------------------------------------------ unfused trio


def _unfused(*qkv_txt_img, txt_seqlens, img_seqlens):
    """The trio composed sample by sample on packed rows, in the fused op's calling convention."""
    q_t, k_t, v_t, q_i, k_i, v_i = qkv_txt_img
    outs_t, outs_i = [], []
    t0 = i0 = 0
    for nt, ni in zip(txt_seqlens, img_seqlens):
        def joint(a, b):
            return torch.cat([a[t0:t0 + nt], b[i0:i0 + ni]]).transpose(0, 1)  # (H, L, d), strided

        o = U.joint_attn_av_gemm(U.joint_attn_softmax(U.joint_attn_qk_gemm(joint(q_t, q_i), joint(k_t, k_i))), joint(v_t, v_i))
        o = o.transpose(0, 1).reshape(nt + ni, -1)
        outs_t.append(o[:nt])
        outs_i.append(o[nt:])
        t0, i0 = t0 + nt, i0 + ni
    return torch.cat(outs_t), torch.cat(outs_i)


def _check_vs_reference(section: str, batch: list[tuple], outs: list[tuple], dtype: torch.dtype) -> None:
    for (s, g), out in zip(batch, outs):
        sub = [t.detach().to("cpu", torch.float64).requires_grad_(True) for t in s]
        nt, ni = s[0].shape[0], s[3].shape[0]
        rt, ri = ref_ops.joint_attention(*sub, (nt,), (ni,))
        rg = torch.autograd.grad((rt, ri), sub, tuple(x.to("cpu", torch.float64) for x in g))
        pairs = [("fwd", out[0], rt), ("fwd", out[1], ri)]
        for i, name in enumerate(("dq", "dk", "dv")):
            pairs += [(name, out[2 + i], rg[i]), (name, out[5 + i], rg[3 + i])]
        for name, got, ref in pairs:
            if ref.numel() == 0:
                continue
            t = tolerance(section, name, dtype)
            ok, max_abs, _ = t.check(got.reshape(ref.shape), ref)
            assert ok, f"{section} {name} (text {nt}, image {ni}): max abs {max_abs:.3e} beyond {t}"


@interp
def test_unfused_trio_vs_reference_and_fused() -> None:
    """qk_gemm → softmax → av_gemm per sample: forward and input gradients vs FP64, forward vs the fused kernel."""
    batch = [_sample(5, 20, 70), _sample(0, 17, 71)]
    outs = bench.run_batch(_unfused, [b[0] for b in batch], [b[1] for b in batch])
    _check_vs_reference("attention_unfused", batch, outs, torch.float32)
    fused = _run(batch)
    tol = tolerance("attention_unfused", "vs_fused", torch.float32)
    for u, f in zip(outs, fused):
        for a, b in zip(u[:2], f[:2]):
            if b.numel():
                ok, max_abs, _ = tol.check(a, b)
                assert ok, f"unfused vs fused: max abs {max_abs:.3e}"
    assert_bytes_equal(bench.run_batch(_unfused, [b[0] for b in batch], [b[1] for b in batch]), outs, "trio repeat")


def test_unfused_bad_inputs() -> None:
    q = torch.zeros(2, 5, D, device=DEV)
    cases = [
        BadCase("qk 2-D", (q[0], q), {}, "3-D"),
        BadCase("qk shapes", (q, q[:, :4]), {}, "one shape"),
        BadCase("qk fp16", (q.half(), q.half()), {}, "fp32 or bf16"),
    ]
    check_bad_inputs(U.joint_attn_qk_gemm, cases)
    check_bad_inputs(U.joint_attn_softmax, [BadCase("not square", (torch.zeros(2, 5, 4, device=DEV),), {}, "square"),
                                            BadCase("strided", (torch.zeros(2, 5, 5, device=DEV).transpose(1, 2),), {}, "contiguous")])
    check_bad_inputs(U.joint_attn_av_gemm, [BadCase("p vs v", (torch.zeros(2, 5, 5, device=DEV), q[:, :4]), {}, "expected p"),
                                            BadCase("dtype", (torch.zeros(2, 5, 5, device=DEV).double(), q), {}, "dtype")])


# ------------------------------------------------------------------------------------------------ GPU


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gpu_accuracy_24x128(dtype: str) -> None:
    """77 + 6889 tokens (divides no tile) vs FP64: tolerances, and for bf16 no worse than 2x SDPA/cuDNN's error."""
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("no CUDA device")
    r = bench.accuracy_case(A, ref_ops, dtype, 77, 6889)
    assert r["pass"], r["checks"]


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gpu_invariance_24x128(dtype: str) -> None:
    """Probe alone == batched (B = 2, 3 at every position), NaN neighbours, repeated backward (bench.invariance)."""
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("no CUDA device")
    r = bench.invariance(A, dtype, (2, 3), 5)
    assert r["pass"], r


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gpu_unfused_trio_24x128(dtype: str) -> None:
    """The trio at 24 heads × 128, 77 + 1999 tokens: forward and input gradients vs FP64 (heads 0–1)."""
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("no CUDA device")
    dt = bench.DTYPES[dtype]
    s = bench.make_sample(77, 1999, heads=24, head_dim=128, dtype=dt, seed=80)
    g = bench.make_grad(s, 81)
    (out,) = bench.run_batch(_unfused, [s], [g])
    (fused,) = bench.run_batch(A.joint_attention_fused, [s], [g])
    heads = bench.REF_HEADS

    def sub(t):
        return t.reshape(t.shape[0], 24, 128)[:, :heads].contiguous()

    batch = [(tuple(sub(t) for t in s), tuple(sub(t).reshape(t.shape[0], -1) for t in g))]
    _check_vs_reference("attention_unfused", batch, [tuple(sub(t) for t in out)], dt)
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out, fused))
    print(f"unfused vs fused ({dtype}): max abs difference over outputs and gradients {diff:.3e}")


@gpu
def test_gpu_other_thread_same_bytes() -> None:
    """A forward + backward on a fresh thread (autograd's device thread, a checkpointed recomputation) runs the
    frozen configuration's TMA loads and gives the main thread's bytes (Triton's allocator is per context)."""
    import threading

    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("no CUDA device")
    s = bench.make_sample(77, 1999, heads=24, head_dim=128, dtype=torch.bfloat16, seed=90)
    g = bench.make_grad(s, 91)
    here = bench.run_batch(A.joint_attention_fused, [s], [g])
    there: list = []
    worker = threading.Thread(target=lambda: there.append(bench.run_batch(A.joint_attention_fused, [s], [g])))
    worker.start()
    worker.join()
    assert there, "the forward + backward on another thread raised (see the thread's traceback above)"
    assert_bytes_equal(there[0], here, "fresh thread vs main thread")


@gpu
def test_gpu_forward_tma_keeps_bytes() -> None:
    """bf16 24 × 128, Triton forward: TMA K/V loads give the pointer path's forward bytes (outputs and LSE) on a
    batch of segments of 0, 1, exact, and partial tiles."""
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("no CUDA device")
    batch = [bench.make_sample(nt, ni, heads=24, head_dim=128, dtype=torch.bfloat16, seed=60 + i)
             for i, (nt, ni) in enumerate(((77, 6889), (0, 128), (128, 4096), (256, 1), (13, 200)))]
    packed, tseq, iseq = bench.pack(batch)
    base = A.config_for(128, torch.bfloat16).replace(fwd_ws=False, fwd_tma=False)
    ref = A.attention_fwd(*packed, tseq, iseq, base)
    got = A.attention_fwd(*packed, tseq, iseq, base.replace(fwd_tma=True))
    assert_bytes_equal(got, ref, "TMA vs pointer loads")


def test_ws_forward_config_is_checked() -> None:
    """The warp-specialized forward refuses what it cannot run (fp32, other tiles, pointer loads) with a clear
    error, and under the interpreter the Triton forward serves it (same bytes)."""
    bf16 = A.config_for(128, torch.bfloat16)
    for cfg, dtype, d, why in ((A.config_for(128, torch.float32), torch.float32, 128, "runs bf16"),
                               (bf16.replace(fwd=(128, 64, 8, 3)), torch.bfloat16, 128, "fwd tiles"),
                               (bf16.replace(fwd=(128, 128, 8, 4)), torch.bfloat16, 128, "2-3 stages"),
                               (bf16.replace(fwd_tma=False), torch.bfloat16, 128, "through TMA")):
        with pytest.raises(ValueError, match=why):
            A._ws_fits(cfg.replace(fwd_ws=True), dtype, d, True)
    assert A._ws_fits(bf16, torch.bfloat16, 128, False) is False  # unaligned base: Triton forward
    if INTERPRET:
        assert A._ws_fits(bf16, torch.bfloat16, 128, True) is False


@gpu
@pytest.mark.parametrize("variant", ["ws", "ws_2_stages"])
def test_gpu_ws_forward_equals_frozen_bytes(variant: str) -> None:
    """The warp-specialized forward (attention_ws) gives the frozen Triton forward's bytes (outputs and LSE) on a
    batch of segments of 0, 1, exact, and partial tiles, beside neighbours of other lengths, and compiles once."""
    from mmdit_strict.kernels.triton import attention_ws as W

    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability()[0] != 9 or not W.available():
        pytest.skip("the warp-specialized forward is written for sm_90 (Hopper) with Triton's Gluon")
    base = A.config_for(128, torch.bfloat16).replace(fwd_ws=False)  # the Triton forward on the same tiles
    option = {"ws": {"fwd_ws": True}, "ws_2_stages": {"fwd_ws": True, "fwd": (128, 128, 8, 2)}}[variant]
    for lens in (((77, 6889), (0, 128), (128, 4096), (256, 1), (13, 200)), ((0, 1), (5, 4000)), ((256, 6032),)):
        batch = [bench.make_sample(nt, ni, heads=24, head_dim=128, dtype=torch.bfloat16, seed=70 + i)
                 for i, (nt, ni) in enumerate(lens)]
        packed, tseq, iseq = bench.pack(batch)
        ref = A.attention_fwd(*packed, tseq, iseq, base)
        if "fwd" in option:
            ref = A.attention_fwd(*packed, tseq, iseq, base.replace(fwd=option["fwd"]))
        got = A.attention_fwd(*packed, tseq, iseq, base.replace(**option))
        assert_bytes_equal(got, ref, f"{variant} vs the Triton forward, lengths {lens}")
    cache = getattr(W._attn_fwd_ws_kernel, "device_caches", None)
    if cache is not None:  # the ws kernel ran (no silent fallback to the Triton forward), one variant per option
        assert 1 <= sum(len(v[0]) for v in cache.values()) <= 3, "one compiled variant per (variant, stages)"


def test_ws_dkdv_config_is_checked() -> None:
    """The warp-specialized dK/dV kernel refuses what it cannot run (fp32, d = 64, other key tiles or query steps,
    more stages than shared memory holds) with a clear error; an unaligned base and the interpreter leave the call to
    the Triton kernel."""
    bf16 = A.config_for(128, torch.bfloat16)
    t = torch.zeros(16, dtype=torch.bfloat16)
    for cfg, dtype, d in ((A.config_for(128, torch.float32), torch.float32, 128), (bf16, torch.bfloat16, 64),
                          (bf16.replace(dkdv=(32, 64, 8, 4)), torch.bfloat16, 128),
                          (bf16.replace(dkdv=(16, 128, 8, 4)), torch.bfloat16, 128),
                          (bf16.replace(dkdv=(32, 128, 8, 11)), torch.bfloat16, 128),
                          (bf16.replace(dkdv=(64, 128, 8, 6)), torch.bfloat16, 128)):
        with pytest.raises(ValueError, match="bwd_ws runs bf16, d = 128"):
            A._bwd_ws_fits(cfg.replace(bwd_ws=True), dtype, d, t)
    assert A._bwd_ws_fits(bf16.replace(bwd_ws=True), torch.bfloat16, 128, t[1:]) is False  # unaligned base
    if INTERPRET:
        assert A._bwd_ws_fits(bf16.replace(bwd_ws=True), torch.bfloat16, 128, t) is False


@gpu
@pytest.mark.parametrize("variant", ["ws", "ws_2_stages", "ws_64_rows"])
def test_gpu_ws_dkdv_equals_frozen_bytes(variant: str) -> None:
    """The warp-specialized dK/dV kernel (attention_bwd_ws) gives the Triton dK/dV kernel's bytes (all six
    gradients) on batches of segments of 0, 1, exact, and partial tiles, beside neighbours of other lengths: with
    the frozen tiles, at 2 stages, and with 64 query rows a step (the same k16 chain per element)."""
    from mmdit_strict.kernels.triton import attention_bwd_ws as BW

    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability()[0] != 9 or not BW.available():
        pytest.skip("the warp-specialized dK/dV kernel is written for sm_90 (Hopper) with Triton's Gluon")
    base = A.config_for(128, torch.bfloat16).replace(bwd_ws=False)
    option = {"ws": {"bwd_ws": True}, "ws_2_stages": {"bwd_ws": True, "dkdv": (32, 128, 8, 2)},
              "ws_64_rows": {"bwd_ws": True, "dkdv": (64, 128, 8, 3)}}[variant]
    for lens in (((77, 6889), (0, 128), (128, 4096), (256, 1), (13, 200)), ((0, 1), (5, 4000)), ((256, 6032),)):
        batch = [bench.make_sample(nt, ni, heads=24, head_dim=128, dtype=torch.bfloat16, seed=80 + i)
                 for i, (nt, ni) in enumerate(lens)]
        packed, tseq, iseq = bench.pack(batch)
        o_t, o_i, lse = A.attention_fwd(*packed, tseq, iseq, base)
        g = torch.Generator(device="cuda").manual_seed(len(lens))
        do_t = torch.randn(o_t.shape, generator=g, device="cuda").to(o_t.dtype)
        do_i = torch.randn(o_i.shape, generator=g, device="cuda").to(o_i.dtype)
        ref = A.attention_bwd(do_t, do_i, *packed, o_t, o_i, lse, tseq, iseq, base)
        got = A.attention_bwd(do_t, do_i, *packed, o_t, o_i, lse, tseq, iseq, base.replace(**option))
        assert_bytes_equal(got, ref, f"{variant} vs the Triton dK/dV kernel, lengths {lens}")
    cache = getattr(BW._attn_bwd_dkdv_ws_kernel, "device_caches", None)
    if cache is not None:  # the ws kernel ran (no silent fallback to the Triton kernel)
        assert sum(len(v[0]) for v in cache.values()) >= 1, "the warp-specialized dK/dV kernel never compiled"


@gpu
def test_gpu_one_compiled_variant_per_config() -> None:
    """Batches of other sizes and lengths reuse the compiled kernels (no batch-derived specialization)."""
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("no CUDA device")
    from mmdit_strict.kernels.triton import attention_bwd_ws as BW
    from mmdit_strict.kernels.triton import attention_ws as W

    kernels = (W._attn_fwd_ws_kernel, BW._attn_bwd_dkdv_ws_kernel, A._attn_bwd_dkdv_kernel, A._attn_bwd_dq_kernel,
               A._bwd_delta_kernel)

    def variants() -> list[int]:
        caches = [getattr(k, "device_caches", None) for k in kernels]
        if any(c is None for c in caches):
            pytest.skip("this Triton exposes no compile cache")
        return [sum(len(v[0]) for v in c.values()) for c in caches]

    counts = None
    for texts, ni in (((77,), 6889), ((0, 256, 13), 4096), ((1,), 1), ((16, 32), 17), ((5,), 4000)):
        batch = [bench.make_sample(nt, ni, heads=24, head_dim=128, dtype=torch.bfloat16, seed=7 + i)
                 for i, nt in enumerate(texts)]
        grads = [bench.make_grad(s, 3) for s in batch]
        bench.run_batch(A.joint_attention_fused, batch, grads)
        now = variants()
        assert counts is None or now == counts, f"new compiled variants for texts {texts}, image {ni}: {counts} -> {now}"
        counts = now


def test_committed_gpu_report_renders() -> None:
    """The qualification report writer renders the committed H200 report (the JSON layout the bench writes)."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "experiments" / "attention" / "f02d17b" / "attention_report.json"
    if not path.exists():
        pytest.skip("no committed report")
    md = bench._markdown(json.loads(path.read_text()))
    for heading in ("## Speed", "## Accuracy", "## Raw-byte invariance", "## Candidate"):
        assert heading in md
    assert "f02d17b" in md


@interp
def test_checkpoint_recompute_takes_the_kept_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a gradient checkpoint with a ``KeptOutputs`` in the context and a slot named (as the strict block does),
    the forward kernel runs once for the forward and its recompute, and every input gradient keeps the bytes of the
    recompute that runs it again."""
    from mmdit_strict.kernels.execution import bind, current
    from mmdit_strict.kernels.kept_outputs import KeptOutputs
    from mmdit_strict.model.strict import checkpointed

    batch = [_sample(5, 20, 40), _sample(0, 33, 41), _sample(17, 9, 42)]
    packed, tseq, iseq = bench.pack([b[0] for b in batch])
    g_txt = torch.cat([b[1][0] for b in batch])
    g_img = torch.cat([b[1][1] for b in batch])
    runs = []
    real = A.attention_fwd
    monkeypatch.setattr(A, "attention_fwd", lambda *a, **k: runs.append(1) or real(*a, **k))

    def block(scale: torch.Tensor, *qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kept = current().kept_outputs
        scaled = [t * scale for t in qkv]  # something the recompute rebuilds before the attention
        with kept.at("block0.joint") if kept is not None else contextlib.nullcontext():
            return A.joint_attention_fused(*scaled, txt_seqlens=tseq, img_seqlens=iseq)

    def step(keep: bool) -> tuple[int, list[torch.Tensor]]:
        runs.clear()
        leaves = [torch.tensor(1.25, requires_grad=True)] + [t.detach().clone().requires_grad_(True) for t in packed]
        with bind(current().replace(kept_outputs=KeptOutputs())) if keep else contextlib.nullcontext():
            o_txt, o_img = checkpointed(block, *leaves, preserve_rng=False)
        grads = torch.autograd.grad((o_txt, o_img), leaves, (g_txt, g_img))
        return len(runs), [o_txt.detach(), o_img.detach(), *grads]

    (n_kept, kept), (n_again, again) = step(True), step(False)
    assert (n_kept, n_again) == (1, 2)
    for i, (a, b) in enumerate(zip(kept, again)):
        assert_bytes_equal(a, b, f"output / gradient {i}: kept outputs vs recomputed")
