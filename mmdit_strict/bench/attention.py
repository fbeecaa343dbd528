"""Benchmark and qualification of the strict joint attention (Triton) on a CUDA GPU.

    python -m mmdit_strict.bench.attention --out DIR [--sections accuracy,invariance,speed,candidates]
        [--repeats 100] [--override-bf16 JSON] [--override-fp32 JSON]

Writes ``DIR/attention_report.json`` and ``DIR/attention_report.md`` (rewritten after every section, so a
run cut short still leaves what it measured):

* environment: GPU, driver, torch, Triton, CUDA, git commit (``MMDIT_COMMIT`` or ``git rev-parse HEAD``);
* accuracy (24 heads × 128, BF16 and FP32): forward and dQ/dK/dV of the kernel (through its autograd
  function) against the FP64 CPU reference ``mmdit_strict.reference.ops.joint_attention`` on heads 0–1
  (heads are independent, so this is an exact subset of the full computation), beside the error of
  torch SDPA on the same inputs (cuDNN backend for BF16, the default backend for FP32 with TF32 off).
  Pass rule: ``tolerances.yaml`` ``attention.<check>.<dtype>`` as ``|kernel − ref| ≤ rtol·|ref| +
  atol_max·max|ref|`` elementwise, and for bf16 ``max|kernel − ref| ≤ 2·max|sdpa − ref|`` (flash-attention's
  rule; reported for fp32, where both errors are ~1e-6 of max|ref|);
* raw-byte invariance: one probe sample (77 text + 6889 image tokens; fp32: 77 + 1999) alone vs in batches
  of 2, 3 and 8 (fp32: 2, 3) at every position beside neighbours with text 0/77/256 and image 4096/6032/6889
  tokens (fp32: 1029/1500) (forward
  outputs and all six input gradients of the probe's rows); the probe beside neighbours whose rows are
  NaN (nothing of theirs is read); repeated backward runs of a mixed batch;
* speed (BF16; FP32 at one shape): forward and backward with ``triton.testing.do_bench`` (median, and
  the 20/80 % quantiles) at 24 heads × (4096 | 6032 | 6889 image + text) tokens for B = 1, 2, 8 with mixed
  text lengths, against SDPA with the cuDNN backend in the same run. FLOPs: forward ``4·H·d·Σ L²`` over
  each sample's own length L, backward counted as 2.5× forward. SDPA runs the padded batch
  ``(B, H, max text + image, d)`` without a mask (for B = 1 the same work); its TFLOP/s are counted on
  its own padded shape and the ratio is of TFLOP/s (for B = 1 it equals the time ratio);
* candidate configurations (informational): overrides of the frozen configurations at 4096 + 128,
  B = 1, passed explicitly through the op's ``config`` argument (the frozen table is not touched); bytes
  compared with the frozen configuration where the tiles are the frozen ones (the load flags, stages and
  the warp-specialized forward only change how the same values reach the same arithmetic).

``--override-bf16`` / ``--override-fp32`` (JSON objects of ``AttentionConfig`` fields, e.g.
``'{"resident_direct": true, "fwd": [128, 64, 8, 3]}'``) qualify a candidate before it is frozen: the accuracy, invariance and speed sections then run
the op with the frozen configuration of that dtype updated by the override (passed through ``config``),
and the report records the override beside the configuration it produced.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import traceback
from pathlib import Path
from collections.abc import Callable
from typing import Any, Sequence

import torch

from ..dtypes import EXECUTION_BY_SHORT_NAME as DTYPES
from . import markdown as md
from ..environment import environment_line, gpu_environment
import torch.nn.functional as F

HEADS, HEAD_DIM = 24, 128
IMAGES = (4096, 6032, 6889)
TEXTS = {1: (128,), 2: (128, 77), 8: (128, 77, 0, 256, 13, 200, 128, 64)}
PROBE = (77, 6889)
NEIGHBOURS = ((0, 4096), (256, 6032), (77, 4096), (0, 6889), (256, 6889), (77, 6032), (0, 6032))
# FP32 (IEEE FMA dots, ~20x slower) runs the same checks at smaller sizes that still divide no tile
PROBE_FP32 = (77, 1999)
NEIGHBOURS_FP32 = ((0, 1029), (256, 1500))
REF_HEADS = 2  # accuracy is checked on heads 0..REF_HEADS-1 against the CPU FP64 reference
# Candidate overrides of the frozen d=128 configurations (informational; see ``candidates``), as (dtype, part,
# override): ``AttentionConfig.replace`` keywords. The frozen configuration itself is the table's baseline row.
CANDIDATES = (
    ("bf16", "fwd", {}),
    ("bf16", "fwd", {"fwd_ws": False}),  # the Triton forward on the same tiles
    ("bf16", "fwd", {"fwd": (128, 128, 8, 2)}),
    ("bf16", "bwd", {"bwd_ws": False}),  # the Triton dK/dV kernel on the same tiles
    ("bf16", "bwd", {"dkdv": (32, 128, 8, 3)}),
    ("bf16", "bwd", {"dkdv": (64, 128, 8, 3)}),  # 64 query rows a step: the same k16 chains (it spills)
)
DEVICE = "cuda"


def _env() -> dict:
    return gpu_environment()


# ----------------------------------------------------------------------------------------- samples


Sample = tuple[torch.Tensor, ...]  # (q_txt, k_txt, v_txt, q_img, k_img, v_img), each (rows, H, d)


def make_sample(nt: int, ni: int, *, heads: int, head_dim: int, dtype: torch.dtype, seed: int,
                device: str | None = None) -> Sample:
    """One sample's q/k/v rows for both streams, N(0, 1) in FP32 from a ``seed``ed generator on the device, then cast."""
    device = device or DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for n in (nt, nt, nt, ni, ni, ni):
        out.append(torch.randn(n, heads, head_dim, generator=g, device=device).to(dtype))
    return tuple(out)


def make_grad(sample: Sample, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream gradients (dO_txt (nt, H·d), dO_img (ni, H·d)) of one sample, N(0, 1) from ``seed``."""
    g = torch.Generator(device=sample[3].device).manual_seed(seed)
    return tuple(torch.randn(t.shape[0], t.shape[1] * t.shape[2], generator=g, device=t.device).to(t.dtype)
                 for t in (sample[0], sample[3]))


def pack(samples: Sequence[Sample]) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], tuple[int, ...]]:
    """Concatenate samples stream by stream: (six packed tensors, txt_seqlens, img_seqlens)."""
    packed = tuple(torch.cat([s[k] for s in samples]).contiguous() for k in range(6))
    return packed, tuple(s[0].shape[0] for s in samples), tuple(s[3].shape[0] for s in samples)


def run_batch(fn, samples: Sequence[Sample], grads: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> list[tuple]:
    """Run ``fn`` (the op's signature) on the packed batch; per sample ``(o_txt, o_img[, six input grads])``.

    With ``grads`` the six inputs require grad and ``Σ_s <dO_s, O_s>`` is back-propagated, so each
    sample's input gradients come from its own upstream gradient.
    """
    packed, tseq, iseq = pack(samples)
    if grads is not None:
        packed = tuple(t.detach().requires_grad_(True) for t in packed)
    with torch.set_grad_enabled(grads is not None):
        o_txt, o_img = fn(*packed, txt_seqlens=tseq, img_seqlens=iseq)
        gradients = None
        if grads is not None:
            g_txt = torch.cat([g[0] for g in grads])
            g_img = torch.cat([g[1] for g in grads])
            gradients = torch.autograd.grad((o_txt, o_img), packed, (g_txt, g_img))
    out = []
    t0 = i0 = 0
    for nt, ni in zip(tseq, iseq):
        row = [o_txt[t0:t0 + nt].detach(), o_img[i0:i0 + ni].detach()]
        if gradients is not None:
            row += [gradients[k][t0:t0 + nt] for k in range(3)] + [gradients[k][i0:i0 + ni] for k in range(3, 6)]
        out.append(tuple(row))
        t0 += nt
        i0 += ni
    return out


def _same_bytes(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    for x, y in zip(a, b):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        w = {4: torch.int32, 2: torch.int16}[x.element_size()]
        if not torch.equal(x.contiguous().view(w), y.contiguous().view(w)):
            return False
    return True


# ----------------------------------------------------------------------------------------- accuracy


def attention_tolerance(check: str, dtype: torch.dtype, ref: torch.Tensor):
    """``tolerances.yaml attention.<check>.<dtype>`` resolved for ``ref`` (``atol_max`` times max|ref| as the absolute atol)."""
    from mmdit_strict.tolerances import tolerance

    return tolerance("attention", check, dtype).resolved(ref)


def _sdpa_batch(samples: Sequence[Sample], backend: str | None):
    """SDPA on the padded batch (B, H, max text + image, d), no mask; returns (fn_fwd, (q, k, v), (Lt_max, L))."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lt = max(s[0].shape[0] for s in samples)
    li = max(s[3].shape[0] for s in samples)
    B = len(samples)
    h, d = samples[0][3].shape[1:]
    dt, dev = samples[0][3].dtype, samples[0][3].device

    def padded(kt: int, ki: int) -> torch.Tensor:
        out = torch.zeros(B, lt + li, h, d, dtype=dt, device=dev)
        for b, s in enumerate(samples):
            out[b, :s[kt].shape[0]] = s[kt]
            out[b, lt:lt + s[ki].shape[0]] = s[ki]
        return out.transpose(1, 2).contiguous()

    qkv = (padded(0, 3), padded(1, 4), padded(2, 5))
    backends = {"cudnn": [SDPBackend.CUDNN_ATTENTION], None: None}[backend]

    def fwd(q, k, v):
        if backends is None:
            return F.scaled_dot_product_attention(q, k, v)
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v)

    return fwd, qkv, (lt, lt + li)


def _op(A, config: Any | None):
    """The op under test: the frozen configuration, or the one ``config`` names (passed through the op's ``config``)."""
    if config is None:
        return A.joint_attention_fused
    return functools.partial(A.joint_attention_fused, config=config)


def accuracy_case(A, ref_ops, dtype_name: str, nt: int, ni: int, config: Any | None = None) -> dict:
    """Kernel and SDPA vs the FP64 reference on one sample, heads 0..REF_HEADS-1 (``config``: see :func:`_op`)."""
    dtype = DTYPES[dtype_name]
    s = make_sample(nt, ni, heads=HEADS, head_dim=HEAD_DIM, dtype=dtype, seed=11)
    g = make_grad(s, seed=12)
    (o_t, o_i, *grads), = run_batch(_op(A, config), [s], [g])
    ours = {"fwd": torch.cat([o_t, o_i]).view(nt + ni, HEADS, HEAD_DIM)[:, :REF_HEADS]}
    for name, gt, gi in (("dq", grads[0], grads[3]), ("dk", grads[1], grads[4]), ("dv", grads[2], grads[5])):
        ours[name] = torch.cat([gt, gi])[:, :REF_HEADS]
    # SDPA on the same sample: (1, H, L, d)
    fwd, (q, k, v), _ = _sdpa_batch([s], "cudnn" if dtype == torch.bfloat16 else None)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    o = fwd(q, k, v)
    go = torch.cat([g[0], g[1]]).view(1, nt + ni, HEADS, HEAD_DIM).transpose(1, 2)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), go)
    peer = {"fwd": o[0].transpose(0, 1)[:, :REF_HEADS], "dq": dq[0].transpose(0, 1)[:, :REF_HEADS],
            "dk": dk[0].transpose(0, 1)[:, :REF_HEADS], "dv": dv[0].transpose(0, 1)[:, :REF_HEADS]}
    # FP64 reference on heads 0..REF_HEADS-1
    sub = [t[:, :REF_HEADS].detach().to("cpu", torch.float64).requires_grad_(True) for t in s]
    rt, ri = ref_ops.joint_attention(*sub, (nt,), (ni,))
    gsub = [x.view(x.shape[0], HEADS, HEAD_DIM)[:, :REF_HEADS].reshape(x.shape[0], -1).to("cpu", torch.float64) for x in g]
    rg = torch.autograd.grad((rt, ri), sub, tuple(gsub))
    ref = {"fwd": torch.cat([rt, ri]).view(nt + ni, REF_HEADS, HEAD_DIM),
           "dq": torch.cat([rg[0], rg[3]]), "dk": torch.cat([rg[1], rg[4]]), "dv": torch.cat([rg[2], rg[5]])}
    out = {"dtype": dtype_name, "text": nt, "image": ni, "checks": {}}
    ok_all = True
    for name in ("fwd", "dq", "dk", "dv"):
        r = ref[name].detach()
        e_ours = float((ours[name].double().cpu() - r).abs().max())
        e_peer = float((peer[name].detach().double().cpu() - r).abs().max())
        tol = attention_tolerance(name, getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype_name]), r)
        ok_tol, _, _ = tol.check(ours[name], r)
        ok_peer = e_ours <= 2 * e_peer
        # the 2x-SDPA rule is a bar for bf16; for fp32 it is reported (errors there are ~1e-6 of max|ref|)
        ok_all &= bool(ok_tol and (ok_peer or dtype == torch.float32))
        out["checks"][name] = {"max_abs_err": e_ours, "sdpa_max_abs_err": e_peer, "ratio_to_sdpa": e_ours / max(e_peer, 1e-30),
                               "max_abs_ref": float(r.abs().max()), "tolerance_pass": bool(ok_tol),
                               "le_2x_sdpa": bool(ok_peer)}
    out["pass"] = ok_all
    return out


# ----------------------------------------------------------------------------------------- invariance


def invariance(A, dtype_name: str, batch_sizes: Sequence[int], repeats: int, config: Any | None = None) -> dict:
    """Byte counts: probe alone vs batched at every position; NaN neighbours; repeated backward (``config``: see :func:`_op`)."""
    dtype = DTYPES[dtype_name]
    fn = _op(A, config)
    probe_spec, neighbour_specs = (PROBE, NEIGHBOURS) if dtype == torch.bfloat16 else (PROBE_FP32, NEIGHBOURS_FP32)
    if max(batch_sizes) - 1 > len(neighbour_specs):
        raise ValueError(f"{dtype_name}: {len(neighbour_specs)} neighbours cannot fill a batch of {max(batch_sizes)}")

    def sample(spec, seed):
        s = make_sample(spec[0], spec[1], heads=HEADS, head_dim=HEAD_DIM, dtype=dtype, seed=seed)
        return s, make_grad(s, seed + 1000)

    probe, probe_g = sample(probe_spec, 1)
    alone = run_batch(fn, [probe], [probe_g])[0]
    neigh = [sample(spec, 10 + i) for i, spec in enumerate(neighbour_specs)]
    res = {"dtype": dtype_name, "probe": list(probe_spec), "neighbours": [list(n) for n in neighbour_specs], "batched": {}}
    for B in batch_sizes:
        others = neigh[:B - 1]
        eq = tot = 0
        for pos in range(B):
            batch = others[:pos] + [(probe, probe_g)] + others[pos:]
            out = run_batch(fn, [b[0] for b in batch], [b[1] for b in batch])[pos]
            eq += int(_same_bytes(out, alone))
            tot += 1
        res["batched"][str(B)] = {"equal": eq, "positions": tot}
    # neighbours full of NaN: nothing of theirs may be read or written over the probe
    nan_n = [tuple(torch.full_like(t, float("nan")) for t in neigh[i][0]) for i in range(2)]
    nan_g = [neigh[i][1] for i in range(2)]
    out = run_batch(fn, [nan_n[0], probe, nan_n[1]], [nan_g[0], probe_g, nan_g[1]])[1]
    res["nan_neighbours_equal"] = bool(_same_bytes(out, alone))
    # repeated backward on a mixed batch
    batch = [neigh[0], (probe, probe_g), neigh[1]]
    first = run_batch(fn, [b[0] for b in batch], [b[1] for b in batch])
    same = 0
    for _ in range(repeats):
        again = run_batch(fn, [b[0] for b in batch], [b[1] for b in batch])
        same += int(all(_same_bytes(a, b) for a, b in zip(again, first)))
    res["repeated_backward"] = {"equal": same, "runs": repeats}
    res["pass"] = (all(v["equal"] == v["positions"] for v in res["batched"].values())
                   and res["nan_neighbours_equal"] and same == repeats)
    return res


# ----------------------------------------------------------------------------------------- speed


def _fwd_flops(lengths: Sequence[int]) -> float:
    return 4.0 * HEADS * HEAD_DIM * sum(L * L for L in lengths)


def _bench(fn) -> dict:
    import triton

    med, lo, hi = triton.testing.do_bench(fn, warmup=25, rep=150, quantiles=[0.5, 0.2, 0.8])
    return {"ms": med, "ms_q20": lo, "ms_q80": hi}


def speed_case(A, dtype_name: str, ni: int, texts: Sequence[int], cfg: Any | None = None, sdpa: bool = True) -> dict:
    dtype = DTYPES[dtype_name]
    samples = [make_sample(nt, ni, heads=HEADS, head_dim=HEAD_DIM, dtype=dtype, seed=100 + b) for b, nt in enumerate(texts)]
    packed, tseq, iseq = pack(samples)
    o_t, o_i, lse = A.attention_fwd(*packed, tseq, iseq, cfg)
    do_t, do_i = torch.randn_like(o_t), torch.randn_like(o_i)
    flops = _fwd_flops([nt + ni for nt in texts])
    res = {"dtype": dtype_name, "B": len(texts), "image": ni, "texts": list(texts)}
    f = _bench(lambda: A.attention_fwd(*packed, tseq, iseq, cfg))
    b = _bench(lambda: A.attention_bwd(do_t, do_i, *packed, o_t, o_i, lse, tseq, iseq, cfg))
    res["ours_fwd"] = {**f, "tflops": flops / f["ms"] * 1e-9}
    res["ours_bwd"] = {**b, "tflops": 2.5 * flops / b["ms"] * 1e-9}
    if sdpa:
        fwd, (q, k, v), (_, L) = _sdpa_batch(samples, "cudnn" if dtype == torch.bfloat16 else None)
        pflops = _fwd_flops([L] * len(texts))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        o = fwd(q, k, v)
        go = torch.randn_like(o)
        with torch.no_grad():
            sf = _bench(lambda: fwd(q, k, v))
        sb = _bench(lambda: torch.autograd.grad(o, (q, k, v), go, retain_graph=True))
        res["sdpa_backend"] = "cudnn" if dtype == torch.bfloat16 else "default"
        res["sdpa_fwd"] = {**sf, "tflops": pflops / sf["ms"] * 1e-9}
        res["sdpa_bwd"] = {**sb, "tflops": 2.5 * pflops / sb["ms"] * 1e-9}
        res["fwd_ratio"] = res["ours_fwd"]["tflops"] / res["sdpa_fwd"]["tflops"]
        res["bwd_ratio"] = res["ours_bwd"]["tflops"] / res["sdpa_bwd"]["tflops"]
    return res


def candidates(A) -> list[dict]:
    """Each override of :data:`CANDIDATES` on the frozen configuration of its dtype, at 4096 + 128, B = 1.

    Forward and backward bytes (the backward from the frozen forward's O and LSE) are compared with the
    frozen configuration's for every row. Where an override keeps the tiles and warps (a load flag,
    the warp-specialized forward, stage count) the same values reach the same arithmetic, so the bytes must not move;
    other tiles change the reduction order and usually the bytes (a new kernel identity if frozen).
    """
    rows = []
    frozen = {}
    for dtype_name, part, override in CANDIDATES:
        dtype = DTYPES[dtype_name]
        base = A.config_for(HEAD_DIM, dtype)
        if dtype_name not in frozen:
            s = make_sample(TEXTS[1][0], IMAGES[0], heads=HEADS, head_dim=HEAD_DIM, dtype=dtype, seed=100)
            packed, tseq, iseq = pack([s])
            o_t, o_i, lse = A.attention_fwd(*packed, tseq, iseq, base)
            do_t, do_i = torch.randn_like(o_t), torch.randn_like(o_i)
            grads = A.attention_bwd(do_t, do_i, *packed, o_t, o_i, lse, tseq, iseq, base)
            frozen[dtype_name] = (packed, tseq, iseq, (o_t, o_i, lse), (do_t, do_i), grads)
        packed, tseq, iseq, fwd_ref, (do_t, do_i), bwd_ref = frozen[dtype_name]
        label = {k: list(v) if isinstance(v, tuple) else v for k, v in override.items()} or "frozen"
        try:
            cfg = base.replace(**override)
            r = speed_case(A, dtype_name, IMAGES[0], TEXTS[1], cfg, sdpa=False)
            row = {"dtype": dtype_name, "part": part, "config": label, "fwd_tflops": r["ours_fwd"]["tflops"],
                   "fwd_ms": r["ours_fwd"]["ms"], "bwd_tflops": r["ours_bwd"]["tflops"], "bwd_ms": r["ours_bwd"]["ms"]}
            row["fwd_bytes_equal_frozen"] = _same_bytes(A.attention_fwd(*packed, tseq, iseq, cfg), fwd_ref)
            row["bwd_bytes_equal_frozen"] = _same_bytes(A.attention_bwd(do_t, do_i, *packed, *fwd_ref, tseq, iseq, cfg), bwd_ref)
            rows.append(row)
        except Exception as exc:  # a candidate that fails to compile is reported, not fatal
            rows.append({"dtype": dtype_name, "part": part, "config": label, "error": repr(exc)[:300]})
    return rows


# ----------------------------------------------------------------------------------------- report


def _speed_row(r: dict) -> str:
    if "error" in r:
        return f"| {r.get('dtype')} | {r.get('B')} | {r.get('image')} | | error: {r['error'][:80]} |||||||"
    nan = float("nan")
    return md.row(r["dtype"], r["B"], r["image"], ",".join(map(str, r["texts"])), f"{r['ours_fwd']['ms']:.3f}",
                  f"{r['ours_fwd']['tflops']:.0f}", f"{r.get('sdpa_fwd', {}).get('tflops', nan):.0f}", f"{r.get('fwd_ratio', nan):.2f}",
                  f"{r['ours_bwd']['ms']:.3f}", f"{r['ours_bwd']['tflops']:.0f}", f"{r.get('sdpa_bwd', {}).get('tflops', nan):.0f}",
                  f"{r.get('bwd_ratio', nan):.2f}")


def _accuracy_rows(r: dict) -> list[str]:
    if "error" in r:
        return [f"| {r.get('dtype')} | | error: {r['error'][:100]} ||||||"]
    return [md.row(r["dtype"], f"{r['text']}+{r['image']}", name, f"{c['max_abs_err']:.3e}", f"{c['sdpa_max_abs_err']:.3e}",
                   f"{c['ratio_to_sdpa']:.2f}", "pass" if c["tolerance_pass"] else "FAIL", "yes" if c["le_2x_sdpa"] else "NO")
            for name, c in r["checks"].items()]


def _invariance_row(r: dict) -> str:
    if "error" in r:
        return f"| {r.get('dtype')} | error: {r['error'][:100]} ||||||"
    b = ", ".join(f"B={k}: {v['equal']}/{v['positions']}" for k, v in r["batched"].items())
    return md.row(r["dtype"], tuple(r["probe"]), " ".join(str(tuple(n)) for n in r["neighbours"]), b,
                  "equal" if r["nan_neighbours_equal"] else "DIFFER",
                  f"{r['repeated_backward']['equal']}/{r['repeated_backward']['runs']}", "yes" if r["pass"] else "NO")


def _candidate_row(r: dict) -> str:
    if "error" in r:
        return f"| {r.get('dtype')} | {r['part']} | {r['config']} | error: {r['error'][:80]} | | | |"
    return md.row(r.get("dtype"), r["part"], r["config"], f"{r['fwd_tflops']:.0f}", f"{r['bwd_tflops']:.0f}",
                  r.get("fwd_bytes_equal_frozen", "—"), r.get("bwd_bytes_equal_frozen", "—"))


def _markdown(rep: dict) -> str:
    env = rep.get("env", {})
    lines = ["# Strict joint attention — H200 qualification", "",
             environment_line(env), "",
             f"Configuration (bf16, d=128): `{rep.get('config_bf16')}`; fp32: `{rep.get('config_fp32')}`", ""]
    if rep.get("overrides"):
        lines += [f"**Candidate under qualification** (frozen configuration updated by): `{rep['overrides']}`", ""]
    if "speed" in rep:
        lines += md.section("Speed (24 heads × 128; SDPA = cuDNN backend for bf16, same run)",
                            ("dtype", "B", "image", "texts", "fwd ms", "fwd TFLOP/s", "SDPA fwd TFLOP/s", "fwd ratio",
                             "bwd ms", "bwd TFLOP/s", "SDPA bwd TFLOP/s", "bwd ratio"),
                            [_speed_row(r) for r in rep["speed"]])
    if "accuracy" in rep:
        lines += md.section("Accuracy vs FP64 (heads 0–1), beside SDPA's own error",
                            ("dtype", "text+image", "check", "max abs err", "SDPA max abs err", "ratio", "tolerance", "≤ 2× SDPA"),
                            [line for r in rep["accuracy"] for line in _accuracy_rows(r)])
    if "invariance" in rep:
        lines += md.section("Raw-byte invariance (fwd outputs and all six input gradients of the probe's rows)",
                            ("dtype", "probe (text, image)", "neighbours", "batched (equal/positions)", "NaN neighbours",
                             "repeated backward", "pass"),
                            [_invariance_row(r) for r in rep["invariance"]])
    if "candidates" in rep:
        lines += md.section("Candidate overrides of the frozen configuration (4096 + 128, B = 1; informational)",
                            ("dtype", "part", "override (BM, BN, warps, stages)", "fwd TFLOP/s", "bwd TFLOP/s",
                             "fwd bytes = frozen", "bwd bytes = frozen"),
                            [_candidate_row(r) for r in rep["candidates"]])
    return "\n".join(lines) + "\n"


def _write(out: Path, rep: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_report.json").write_text(json.dumps(rep, indent=2, default=str))
    (out / "attention_report.md").write_text(_markdown(rep))


def _parse_override(text: str | None, flag: str) -> dict:
    """A configuration override from the command line: a JSON object; lists become the config's tuples."""
    if not text:
        return {}
    try:
        items = json.loads(text).items()
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{flag}: expected a JSON object, got {text!r}") from None
    return {k: tuple(v) if isinstance(v, list) else v for k, v in items}


def _case_or_error(error_fields: dict, case: Callable[..., dict], *args: Any) -> dict:
    """``case(*args)``'s report row, or, when it raises, an error row: ``error_fields``, the exception and the
    end of its traceback (a failing case is reported in its section and fails the run, it does not stop it)."""
    try:
        return case(*args)
    except Exception as exc:
        return {**error_fields, "error": repr(exc)[:500], "trace": traceback.format_exc()[-2000:]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/local")
    p.add_argument("--sections", default="accuracy,invariance,speed,candidates")
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--override-bf16", default=None, help="JSON object: qualify the frozen bf16 d=128 configuration updated by it")
    p.add_argument("--override-fp32", default=None, help="JSON object: the same for fp32")
    args = p.parse_args(argv)
    overrides = {"bf16": _parse_override(args.override_bf16, "--override-bf16"),
                 "fp32": _parse_override(args.override_fp32, "--override-fp32")}
    if not torch.cuda.is_available():
        raise ValueError("the attention bench needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from mmdit_strict.kernels.triton import attention as A
    from mmdit_strict.reference import ops as ref_ops

    out = Path(args.out)
    configs = {dt: (A.config_for(HEAD_DIM, DTYPES[dt]).replace(**overrides[dt]) if overrides[dt] else None) for dt in DTYPES}
    rep: dict = {"env": _env(), "config_bf16": (configs["bf16"] or A.config_for(HEAD_DIM, torch.bfloat16)).as_dict(),
                 "config_fp32": (configs["fp32"] or A.config_for(HEAD_DIM, torch.float32)).as_dict(),
                 "overrides": {dt: o for dt, o in overrides.items() if o}}
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    failed = False
    for section in sections:
        t0 = time.time()
        if section == "speed":
            rep["speed"] = []
            cases = [("bf16", ni, TEXTS[B]) for ni in IMAGES for B in (1, 2, 8)] + [("fp32", IMAGES[0], TEXTS[1])]
            for dt, ni, texts in cases:
                r = _case_or_error({"dtype": dt, "B": len(texts), "image": ni}, speed_case, A, dt, ni, texts, configs[dt])
                failed |= "error" in r
                rep["speed"].append(r)
        elif section == "accuracy":
            rep["accuracy"] = []
            for dt in ("bf16", "fp32"):
                for nt, ni in ((128, 4096), (77, 6889)):
                    r = _case_or_error({"dtype": dt}, accuracy_case, A, ref_ops, dt, nt, ni, configs[dt])
                    failed |= "error" in r or not r["pass"]
                    rep["accuracy"].append(r)
        elif section == "invariance":
            rep["invariance"] = []
            for dt, sizes, repeats in (("bf16", (2, 3, 8), args.repeats), ("fp32", (2, 3), 3)):
                r = _case_or_error({"dtype": dt}, invariance, A, dt, sizes, repeats, configs[dt])
                failed |= "error" in r or not r["pass"]
                rep["invariance"].append(r)
        elif section == "candidates":
            rep["candidates"] = candidates(A)
        else:
            raise ValueError(f"unknown section {section!r}")
        rep.setdefault("section_seconds", {})[section] = round(time.time() - t0, 1)
        _write(out, rep)
    print(_markdown(rep))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
