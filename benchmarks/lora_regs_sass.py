"""Probe (offline, no GPU): does the GEMM main kernel's LoRA term spill on the big image tiles?

``bench lora_tiles`` (``experiments/gemm/f1e536d_lora_term``) timed the LoRA term at 1.25–1.76× the big products'
adapter-free time, far above its arithmetic. The term keeps a second FP32 accumulator the size of the output tile
(128 × 256 on the image stream's big tile: 128 registers per thread at 8 warps, as many as the main accumulator).
This builds ``_gemm_fwd_kernel`` for sm_90 with the Triton wheel the H200 runs (``benchmarks/sm90.py``), with each
LoRA layer's configured tile for the forward and dX (the image stream at 4224 rows, the text stream at a prompt's
128 rows), with and without the term, and reports registers per thread,
stack bytes (spills) and local-memory instructions (``LDL`` / ``STL``) in the SASS.

The launch arguments mirror ``gemm/launch._main`` for a GPU call (tensor descriptors where the configuration takes
them; CPU tensors stand in for the operands, only their dtype and alignment enter the build).

    python -m benchmarks.lora_regs_sass --triton /path/to/unpacked/triton-3.6-wheel [--epi-split 1 2 4] [--digest]

``--digest`` adds each build's SASS digest (SHA-256 of its instruction listing): a kernel-source edit meant to move
no arithmetic (a dropped unused argument, a deduplicated mask) keeps every digest, which is evidence that the GPU
runs the very same instructions, hence gives the same bytes.

(Any Triton with its NVIDIA backend builds them; the installed one too, which a CPU test uses to check that the
LoRA launches compile for the GPU at all: the interpreter runs code the GPU compiler refuses.)
"""

from __future__ import annotations

import argparse
import hashlib
import itertools

from benchmarks.sm90 import Sm90Compiler, count_ops, instructions, use_wheel

ROWS = 4224  # 4096 image + 128 text tokens
TEXT_ROWS = 128  # a prompt's rows in the text stream
RANK = 64
SMS = 132  # H200


def _case(torch, C, K, TensorDescriptor, k: int, n: int, epilogue: int, dx: bool, lora: bool, epi_split: int | None,
          stream: str = "image", gate: bool = False):
    """(args, kwargs) of the main kernel's launch for layer (k → n): its forward, or its dX (dZ (M, n) @ W → (M, k)),
    in ``stream`` (the text stream's launches run over the prompt's rows). ``gate``: the forward with the gated
    residual in its epilogue (``epilogue`` is then ``Act.GATE_RESIDUAL``; two samples, the gate a row-strided chunk)."""
    dt = torch.bfloat16
    m = ROWS if stream == "image" else TEXT_ROWS
    if dx:
        kk, nn = n, k  # dX reduces over the layer's N and writes its K columns
        cfg = C.fwd_config(nn, kk, dt, stream)
        a = torch.empty(m, kk, dtype=dt)
        w = torch.empty(n, k, dtype=dt)  # read as (K = n, N = k), row-major: the "kn" form
        nk = False
    else:
        kk, nn = k, n
        cfg = C.fwd_config(nn, kk, dt, stream)
        a = torch.empty(m, kk, dtype=dt)
        w = torch.empty(n, k, dtype=dt)
        nk = cfg.weight_layout == "nk"
    if epi_split:
        cfg = cfg.replace(epi_split=epi_split)
    bn, bk = min(cfg.BLOCK_N, nn), min(cfg.BLOCK_K, kk)
    store_pre = bool(epilogue) and not dx and not gate
    tma_store = cfg.tma and cfg.tma_store
    out = torch.empty(m, nn, dtype=dt)
    pre = torch.empty(m, nn, dtype=dt) if store_pre else out
    split = cfg.epi_split if bn % (16 * cfg.epi_split) == 0 else 1
    if cfg.tma:
        a_arg = TensorDescriptor(a, [m, kk], [kk, 1], [cfg.BLOCK_M, bk])
        b_arg = (TensorDescriptor(w, [nn, kk], [kk, 1], [bn, bk]) if nk
                 else TensorDescriptor(w, [kk, nn], [nn, 1], [bk, bn]))
        o_arg = TensorDescriptor(out, [m, nn], [nn, 1], [cfg.BLOCK_M, bn // split]) if tma_store else out
    else:
        a_arg, b_arg, o_arg = a, w, out
    strides = (kk, 1, kk, nn) if nk else (kk, nn, 1, nn)
    if lora:
        u = torch.empty(m, RANK, dtype=dt)
        if dx:
            la = torch.empty(RANK, k, dtype=dt)  # + s · v A: A (r, K) read as (r, N = k)
            lora_args = (u, RANK, la, k, 1, RANK, 1.0)
        else:
            lb = torch.empty(n, RANK, dtype=dt)  # + s · u Bᵀ: B (N, r) read as (r, N)
            lora_args = (u, RANK, lb, 1, RANK, RANK, 1.0)
    else:
        lora_args = (out, 0, out, 0, 0, 0, 1.0)
    bias = torch.empty(nn, dtype=dt)
    has_bias = not dx
    epi = (bias if has_bias else out, out, 0, out, pre)
    gate_args = None
    if gate:
        residual = torch.empty(m, nn, dtype=dt)
        chunk = torch.empty(2, 6 * nn, dtype=dt)[:, 2 * nn:3 * nn]
        epi = (bias, residual, nn, out, out)
        gate_args = (chunk, chunk.stride(0), torch.empty(m, dtype=torch.int32))
    spec = K.FwdSpec(PROLOGUE=0, EPILOGUE=0 if dx else epilogue, HAS_BIAS=has_bias, HAS_LORA=lora, STORE_PRE=store_pre,
                     EVEN_K=kk % bk == 0, DOT_PRECISION="ieee", BLOCK_M=cfg.BLOCK_M, BLOCK_N=bn, BLOCK_K=bk,
                     BLOCK_R=RANK if lora else 16, GROUP_M=cfg.GROUP_M, USE_TMA=cfg.tma, W_NK=cfg.tma and nk, TMA_STORE=tma_store,
                     EPI_SPLIT=split, NUM_PROGRAMS=SMS if cfg.persistent else 0)
    kw = {"CFG": spec, "num_warps": cfg.num_warps, "enable_fp_fusion": False, "num_stages": cfg.num_stages}
    return (a_arg, b_arg, o_arg, strides, lora_args, epi, m, nn, kk, gate_args), kw, cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--triton", required=True, help="an unpacked Triton wheel, 3.6 as on the H200 (the directory holding triton/)")
    p.add_argument("--epi-split", type=int, nargs="+", default=None, choices=(1, 2, 4),
                   help="build with these epilogue splits instead of the configured one")
    p.add_argument("--stream", choices=("image", "text"), nargs="+", default=["image", "text"])
    p.add_argument("--pass", dest="passes", choices=("forward", "dX"), nargs="+", default=["forward", "dX"])
    p.add_argument("--layer", choices=("3072x3072", "3072x12288", "12288x3072"), nargs="+", default=None,
                   help="only these layers (in x out); default all three")
    p.add_argument("--lora-only", action="store_true", help="only the launches with the LoRA term")
    p.add_argument("--digest", action="store_true", help="add a column with the SHA-256 of each build's SASS instructions")
    p.add_argument("--gate", action="store_true",
                   help="build the forwards with the gated residual in the epilogue instead (layers with no activation)")
    args = p.parse_args(argv)
    triton_dir = use_wheel(args.triton)
    import torch
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mmdit_strict.kernels.triton import configs as C
    from mmdit_strict.kernels.triton.gemm import kernels as K
    from mmdit_strict.kernels.triton.gemm.codes import Act

    compiler = Sm90Compiler(triton_dir)
    print(f"Triton {triton.__version__} from {triton_dir}, sm_90, {ROWS} rows, rank {RANK}\n")
    digest_head = (" SASS sha256 |", "---|") if args.digest else ("", "")
    print("| layer | pass | tile (M × N × K, warps, stages) | epilogue parts | LoRA term | regs | stack B | LDL | STL |"
          + digest_head[0])
    print("|---|---|---|---|---|---|---|---|---|" + digest_head[1])
    layers = [(k, n, e) for k, n, e in ((3072, 3072, Act.NONE), (3072, 12288, Act.GELU_TANH), (12288, 3072, Act.NONE))
              if args.layer is None or f"{k}x{n}" in args.layer]
    dxs = [p == "dX" for p in args.passes]
    if args.gate:  # the gated residual follows the products without an activation, forward only
        layers = [(k, n, Act.GATE_RESIDUAL) for k, n, e in layers if e == Act.NONE]
        dxs = [False]
    terms = (True,) if args.lora_only else (False, True)
    for stream, (k, n, epilogue), split, dx, lora in itertools.product(args.stream, layers, args.epi_split or (None,), dxs,
                                                                       terms):
        a, kw, cfg = _case(torch, C, K, TensorDescriptor, k, n, int(epilogue), dx, lora, split, stream, args.gate)
        b = compiler.build(K._gemm_fwd_kernel, a, kw)
        listing = instructions(b.sass)
        ops = count_ops([o for _, o, _ in listing], ("LDL", "STL"))
        digest = ""
        if args.digest:
            digest = " " + hashlib.sha256("\n".join(f"{a:x} {o}{r}" for a, o, r in listing).encode()).hexdigest()[:16] + " |"
        tile = f"{cfg.BLOCK_M} × {cfg.BLOCK_N} × {cfg.BLOCK_K}, {cfg.num_warps}, {cfg.num_stages}"
        label = {Act.GELU_TANH: " GELU", Act.GATE_RESIDUAL: " + gated residual"}.get(epilogue, "")
        print(f"| {stream}: {k} → {n}{label} | {'dX' if dx else 'forward'} | {tile} | "
              f"{kw['CFG'].EPI_SPLIT} | {'yes' if lora else 'no'} | {b.regs} | {b.stack} | {ops['LDL']} | {ops['STL']} |"
              + digest,
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
