"""LoRA product tiles on the GPU: the rank-r products of a training step under candidate tiles.

    python -m mmdit_strict.bench.lora_tiles --out DIR [--rank 64] [--rows 4224]

A LoRA layer ``K → N`` of rank ``r`` adds four thin products to its step: ``u = x Aᵀ`` (M × r, K long) and
``v = dZ B`` (M × r, N long) through the main kernel, ``dA = vᵀ x`` (r × K) and ``dB = dZᵀ u`` (N × r) through
the weight-gradient kernel. With ``r = 64`` their output has few tiles, so the configured tile leaves most
SMs idle. For each product class of Qwen-Image's LoRA targets this times the configured tile and
candidates that keep its reduction step (the main kernel's ``BLOCK_K``, the weight-gradient kernel's
``BLOCK_M``) and records whether each gives the configured tile's bytes (``torch.equal``): a candidate that
does is a pure speed choice; one that does not would be an arithmetic change.

A second section times what the LoRA term costs the layer's big products: the training forward (with the
pre-activation stored where an epilogue needs it) and dX, each with and without the adapter (``u`` or ``v``
and the main kernel's LoRA term), replayed from CUDA graphs, and the forward main kernel's registers and spills
with and without the term (its second FP32 accumulator). Writes ``lora_tiles.json`` and
``lora_tiles.md``. A benchmark: nothing here asserts.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

import torch

from ..environment import environment_line, gpu_environment
from ..kernels.triton import configs
from .output import write_report
from .timing import kernel_stats, plain_ms

# the (in, out) features of the LoRA-adapted Qwen-Image layers: q/k/v/out, MLP up, MLP down
LAYERS = ((3072, 3072), (3072, 12288), (12288, 3072))


def _fwd_candidates(base: configs.FwdConfig) -> list[configs.FwdConfig]:
    bk = base.BLOCK_K
    shapes = [(16, 64, 4, 4), (32, 64, 4, 4), (32, 64, 4, 6), (64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 6),
              (128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4), (32, 32, 4, 4)]
    return [configs.FwdConfig(bm, bn, bk, w, s) for bm, bn, w, s in shapes]


def _dw_candidates(base: configs.DwConfig, n: int, k: int) -> list[configs.DwConfig]:
    bm = base.BLOCK_M
    if n <= 128:  # (r, K): the K side carries the tiles
        tiles = [(64, 16), (64, 32), (64, 64), (64, 128), (32, 32), (32, 64)]
    else:  # (N, r)
        tiles = [(16, 64), (32, 64), (64, 64), (128, 64), (32, 32), (64, 32)]
    return [configs.DwConfig(bn, bk, bm, w, s) for bn, bk in tiles for w, s in ((4, 3), (4, 4))]


def _sweep(name: str, run: Callable[[Any], torch.Tensor], base: Any, candidates: Sequence[Any]) -> dict[str, Any]:
    ref = run(base)
    row: dict[str, Any] = {"product": name, "configured": base.as_dict(), "configured_ms": plain_ms(lambda: run(base)),
                           "candidates": []}
    for cand in candidates:
        try:
            out = run(cand)
            same = bool(torch.equal(out, ref))
            row["candidates"].append({"config": cand.as_dict(), "ms": plain_ms(lambda: run(cand)), "same_bytes": same})
        except Exception as exc:  # a tile that does not compile or launch here: record why
            row["candidates"].append({"config": cand.as_dict(), "error": f"{type(exc).__name__}: {exc}"[:200]})
    same = [c for c in row["candidates"] if c.get("same_bytes")]
    if same:
        best = min(same, key=lambda c: c["ms"])
        row["best_same_bytes"] = best
        row["speedup"] = row["configured_ms"] / best["ms"]
    return row


def run(rank: int, rows: int) -> list[dict[str, Any]]:
    """Every product class of the LoRA layers, configured tile against candidates (BF16, CUDA)."""
    from ..kernels.triton.gemm import launch as L

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    seqlens = (rows,)
    out: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    for k, n in LAYERS:
        x = torch.randn(rows, k, device=dev, dtype=dt, generator=g)
        dz = torch.randn(rows, n, device=dev, dtype=dt, generator=g)
        a = (torch.randn(rank, k, device=dev, generator=g) / k ** 0.5).to(dt)
        b = (torch.randn(n, rank, device=dev, generator=g) / rank ** 0.5).to(dt)
        u = torch.randn(rows, rank, device=dev, dtype=dt, generator=g)
        products = [
            (f"u = x Aᵀ ({rows}×{k} · {k}×{rank})", ("fwd", rank, k),
             lambda c, x=x, a=a, k=k: L._main(x, L.Operand(a, (1, k)), rank, c)[0], configs.fwd_config(rank, k, dt)),
            (f"v = dZ B ({rows}×{n} · {n}×{rank})", ("fwd", rank, n),
             lambda c, dz=dz, b=b: L._main(dz, L.Operand(b, (rank, 1)), rank, c)[0], configs.fwd_config(rank, n, dt)),
            (f"dA = vᵀ x ({rank}×{k})", ("dw", rank, k),
             lambda c, u=u, x=x: L.gemm_dw(u, x, seqlens, scale=0.5, config=c), configs.dw_config(rank, k, dt)),
            (f"dB = dZᵀ u ({n}×{rank})", ("dw", n, rank),
             lambda c, dz=dz, u=u: L.gemm_dw(dz, u, seqlens, scale=0.5, config=c), configs.dw_config(n, rank, dt)),
        ]
        for name, key, fn, base in products:
            if key in seen:
                continue
            seen.add(key)
            cands = _fwd_candidates(base) if key[0] == "fwd" else _dw_candidates(base, key[1], key[2])
            row = _sweep(name, fn, base, cands)
            row["key"] = list(key)
            out.append(row)
            print(f"{name}: configured {row['configured_ms']:.3f} ms, best same-bytes "
                  f"{row.get('best_same_bytes', {}).get('ms', float('nan')):.3f} ms", flush=True)
    return out


#: the model's bias and epilogue per LoRA layer (in, out): the MLP up projection's tanh-GELU needs its pre-activation
_EPILOGUES = {(3072, 12288): "gelu_tanh"}


def lora_term_cases(rank: int, rows: int, device: str, layers: Sequence[tuple[int, int]] = LAYERS,
                    dtype: torch.dtype = torch.bfloat16,
                    epilogues: dict[tuple[int, int], str] = _EPILOGUES) -> list[dict[str, Any]]:
    """Per layer and pass (training forward, dX): the call without the adapter and the call with it. A forward's
    calls take an optional ``on_launch`` callback (the main kernel's compiled handle, as ``gemm_fwd``'s)."""
    from ..kernels.streams import current_gemm_stream
    from ..kernels.triton.gemm import launch as L

    stream = current_gemm_stream()
    g = torch.Generator(device=device).manual_seed(1)
    seqlens = (rows,)
    cases = []
    for k, n in layers:
        epi = epilogues.get((k, n), "none")
        x = torch.randn(rows, k, device=device, generator=g).to(dtype)
        w = (torch.randn(n, k, device=device, generator=g) / k ** 0.5).to(dtype)
        bias = (0.1 * torch.randn(n, device=device, generator=g)).to(dtype)
        lora = ((torch.randn(rank, k, device=device, generator=g) / k ** 0.5).to(dtype),
                (torch.randn(n, rank, device=device, generator=g) / rank ** 0.5).to(dtype), 1.0)
        dy = torch.randn(rows, n, device=device, generator=g).to(dtype)
        store = epi != "none"
        _, pre, _ = L.gemm_fwd(x, w, bias, epilogue=epi, store_pre=store)
        _, pre_l, u = L.gemm_fwd(x, w, bias, epilogue=epi, store_pre=store, lora=lora)
        dx_only = (True, False, False, False, False)
        fwd4 = configs.fwd_config(n, k, dtype, stream).replace(epi_split=4)  # the epilogue in four column parts
        dx4 = configs.fwd_config(k, n, dtype, stream).replace(epi_split=4)
        layer = f"{k} → {n}" + (f" ({epi})" if store else "")
        cases.append({"layer": layer, "pass": "forward",
                      "plain": lambda cb=None, x=x, w=w, b=bias, e=epi, s=store: L.gemm_fwd(
                          x, w, b, epilogue=e, store_pre=s, on_launch=cb)[0],
                      "lora": lambda cb=None, x=x, w=w, b=bias, e=epi, s=store, lo=lora: L.gemm_fwd(
                          x, w, b, epilogue=e, store_pre=s, lora=lo, on_launch=cb)[0],
                      "lora_4parts": lambda cb=None, x=x, w=w, b=bias, e=epi, s=store, lo=lora, c=fwd4: L.gemm_fwd(
                          x, w, b, epilogue=e, store_pre=s, lora=lo, config=c, on_launch=cb)[0]})
        cases.append({"layer": layer, "pass": "dX",
                      "plain": lambda dy=dy, x=x, w=w, e=epi, p=pre: L.gemm_bwd(
                          dy, x, w, seqlens=seqlens, epilogue=e, pre=p, needs=dx_only)[0],
                      "lora": lambda dy=dy, x=x, w=w, e=epi, p=pre_l, lo=lora, u=u: L.gemm_bwd(
                          dy, x, w, seqlens=seqlens, epilogue=e, pre=p, lora=lo, u=u, needs=dx_only)[0],
                      "lora_4parts": lambda dy=dy, x=x, w=w, e=epi, p=pre_l, lo=lora, u=u, c=dx4: L.gemm_bwd(
                          dy, x, w, seqlens=seqlens, epilogue=e, pre=p, lora=lo, u=u, needs=dx_only, dx_config=c)[0]})
    return cases


def lora_term(rank: int, rows: int) -> list[dict[str, Any]]:
    """GPU time (graph replay) of each case of :func:`lora_term_cases`, without and with the adapter."""
    from .timing import graph_ms

    out = []
    for case in lora_term_cases(rank, rows, "cuda"):
        plain, lora, lora4 = (graph_ms(case[w], rep=100) for w in ("plain", "lora", "lora_4parts"))
        same = torch.equal(case["lora"](), case["lora_4parts"]())
        row = {"layer": case["layer"], "pass": case["pass"], "plain_ms": plain, "lora_ms": lora,
               "ratio": lora / plain if plain and lora else None, "lora_4parts_ms": lora4,
               "ratio_4parts": lora4 / plain if plain and lora4 else None, "4parts_same_bytes": same}
        if case["pass"] == "forward":  # the main kernel's registers and spills: does the LoRA accumulator spill?
            row["regs_spills"] = {which: kernel_stats(case[which])[1] for which in ("plain", "lora", "lora_4parts")}
        out.append(row)
        print(f"{case['layer']} {case['pass']}: {plain} ms plain, {lora} ms with the adapter, {lora4} ms with it "
              f"in four epilogue parts ({'same' if same else 'OTHER'} bytes)", flush=True)
    return out


def _regs(r: dict[str, Any], which: str) -> str:
    rs = (r.get("regs_spills") or {}).get(which)
    return "—" if not rs or rs[0] is None else f"{rs[0]} / {rs[1]}"


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def render(report: dict[str, Any]) -> str:
    lines = [f"# LoRA product tiles (rank {report['rank']}, {report['rows']} rows, BF16)", "",
             environment_line(report["environment"]), "",
             "| product | configured ms | best same-bytes ms | speed-up | best tile | candidates with other bytes |",
             "|---|---|---|---|---|---|"]
    for row in report["products"]:
        best = row.get("best_same_bytes")
        other = sum(1 for c in row["candidates"] if c.get("same_bytes") is False)
        tile = {k: v for k, v in best["config"].items() if k.isupper() or k in ("num_warps", "num_stages")} if best else "—"
        lines.append(f"| {row['product']} | {row['configured_ms']:.3f} | {best['ms'] if best else float('nan'):.3f} | "
                     f"{row.get('speedup', float('nan')):.2f} | {tile} | {other} of {len(row['candidates'])} |")
    if report.get("lora_term"):
        lines += ["", "## What the LoRA term costs the big products (CUDA-graph replay)", "",
                  "Registers / spills per thread of the main kernel, forward only.", "",
                  "| layer | pass | without adapter ms | with adapter ms | × | with adapter, 4 epilogue parts ms | × | "
                  "same bytes | regs / spills without | with | with, 4 parts |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['layer']} | {r['pass']} | {_fmt(r['plain_ms'], '.4f')} | {_fmt(r['lora_ms'], '.4f')} | "
                  f"{_fmt(r['ratio'], '.2f')} | {_fmt(r.get('lora_4parts_ms'), '.4f')} | {_fmt(r.get('ratio_4parts'), '.2f')} | "
                  f"{ {True: 'yes', False: '**no**'}.get(r.get('4parts_same_bytes'), '—') } | {_regs(r, 'plain')} | "
                  f"{_regs(r, 'lora')} | {_regs(r, 'lora_4parts')} |" for r in report["lora_term"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmdit_strict.bench.lora_tiles", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="experiments/local", help="output folder")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--rows", type=int, default=4224, help="rows of the products (4096 image + 128 text tokens)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.lora_tiles needs a CUDA GPU")
    report = {"rank": args.rank, "rows": args.rows, "environment": gpu_environment(),
              "products": run(args.rank, args.rows), "lora_term": lora_term(args.rank, args.rows)}
    print(write_report(args.out, "lora_tiles", report, render))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
