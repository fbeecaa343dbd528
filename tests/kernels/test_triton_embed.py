"""CUDA strict timestep embedding (``kernels/triton/embed.py``): the sinusoid and the two engine linears.

Without CUDA the GEMM engine runs under ``TRITON_INTERPRET=1`` (FP32, tiny widths, CI); with CUDA the
``@pytest.mark.gpu`` tests run Qwen-Image's widths (256 → 3072 → 3072) in bf16 and fp32. Tolerances:
``tolerances.yaml`` ``ops.timestep_embed_mlp[_grad]`` (FP32; the sinusoid is FP64 rounded once) and,
for bf16, the GEMM engine's ``gemm.<check>.bf16`` (the table and the hidden activation are bf16 cast
points, as the engine's SiLU prologue is).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mmdit_strict.bench.gemm import gemm_tolerance  # noqa: E402
from mmdit_strict.kernels.triton import embed as E  # noqa: E402
from mmdit_strict.reference import ops as ref  # noqa: E402
from mmdit_strict.tolerances import tolerance  # noqa: E402
from tests.harness import (  # noqa: E402
    CPU_FP32,
    BadCase,
    Target,
    assert_bytes_equal,
    check_bad_inputs,
    check_grad_accuracy,
    check_param_grad_fold,
    check_row_invariance,
    generator,
    randn,
    rows_op,
    run_with_grads,
)
from tests.kernels.triton_rows import GPU_TARGETS, interp, on_gpu_targets, skip_unless_compiled  # noqa: E402  (mode: tests/conftest.py)

C, D = 32, 40  # sinusoid channels and model width (non-multiples of the small-shape tiles)
SIGMAS = torch.tensor([1.0, 0.5, 0.02, 0.0, 0.731], dtype=torch.float32)


def _params(c: int, d: int, target: Target = CPU_FP32, seed: int = 1) -> list[torch.Tensor]:
    g = generator(seed)
    return [randn(d, c, gen=g, target=target, scale=c**-0.5), randn(d, gen=g, target=target, scale=0.1),
            randn(d, d, gen=g, target=target, scale=d**-0.5), randn(d, gen=g, target=target, scale=0.1)]


def _tol(target: Target) -> dict:
    """FP32 bounds (``ops.timestep_embed_mlp[_grad]``); bf16 bounds are built per tensor in the GPU test."""
    return {"fwd": tolerance("ops", "timestep_embed_mlp", "fp32"), "grad": tolerance("ops", "timestep_embed_mlp_grad", "fp32")}


def _sigma_row(gen: torch.Generator) -> torch.Tensor:
    return torch.rand(1, generator=gen, dtype=torch.float32)[0]


@interp
def test_accuracy_and_tile_moves_interpreter():
    """Forward and the four parameter gradients vs the FP64 reference; a sample's row keeps its bytes
    whatever the batch. Under the interpreter ``tl.dot`` is numpy's matmul, which may round a row
    differently by its position inside the 16-row tile, so rows move by whole tiles here; the GPU
    tests move them by any offset and check the parameter-gradient fold."""
    w1, b1, w2, b2 = _params(C, D)
    kw = dict(channels=C, scale=1000.0)
    check_grad_accuracy(lambda s, *p: E.timestep_embed_mlp(s, *p, **kw), lambda s, *p: ref.timestep_embed_mlp(s, *p, **kw),
                        [SIGMAS, w1, b1, w2, b2], _tol(CPU_FP32), wrt=[1, 2, 3, 4], what="triton timestep_embed_mlp")
    sig = torch.rand(40, generator=generator(3))
    full = E.timestep_embed_mlp(sig, w1, b1, w2, b2, **kw)
    for off, m in ((0, 1), (0, 7), (0, 17), (0, 39), (16, 5), (32, 8)):
        part = E.timestep_embed_mlp(sig[off:off + m], w1, b1, w2, b2, **kw)
        assert_bytes_equal(part, full[off:off + m], f"sigmas {off}..{off + m} alone vs in a batch of 40")


@interp
def test_bad_inputs_raise_clear_errors():
    w1, b1, w2, b2 = _params(C, D)
    kw = {"channels": C, "scale": 1000.0}
    check_bad_inputs(E.timestep_embed_mlp, [
        BadCase("2-d sigma", (torch.zeros(2, 1), w1, b1, w2, b2), kw, "(B,)"),
        BadCase("fp64 sigma", (torch.zeros(2, dtype=torch.float64), w1, b1, w2, b2), kw, "float32"),
        BadCase("odd channels", (torch.zeros(2), w1, b1, w2, b2), {"channels": 31, "scale": 1000.0}, "even"),
        BadCase("w1 width", (torch.zeros(2), w1[:, :-2], b1, w2, b2), kw, "w1 of shape"),
        BadCase("fp16 weights", (torch.zeros(2), w1.half(), b1, w2, b2), kw, "fp32 or bf16"),
    ])


def test_registered_for_cuda_strict_fp32_and_bf16():
    from mmdit_strict.kernels.registry import implementations

    impls = [i for i in implementations("timestep_embed_mlp") if i.backend == "triton"]
    assert len(impls) == 1 and impls[0].device == "cuda" and impls[0].strict
    assert impls[0].dtypes == frozenset({torch.float32, torch.bfloat16})


# ------------------------------------------------------------------------------------------------
# GPU: Qwen-Image's widths (never in CI)
# ------------------------------------------------------------------------------------------------

QWEN_C, QWEN_D = 256, 3072


@on_gpu_targets
def test_gpu_rows_are_batch_invariant(target):
    skip_unless_compiled(target)
    p = _params(QWEN_C, QWEN_D, target)
    # the harness puts every input in the target dtype; sigma enters the op as FP32, as the model passes it
    check_row_invariance(rows_op(lambda s: E.timestep_embed_mlp(s.float(), *p, channels=QWEN_C, scale=1000.0)), _sigma_row,
                         target=target, what=f"triton timestep_embed_mlp {target.label}")


@on_gpu_targets
def test_gpu_accuracy(target):
    """Output and each parameter gradient vs the FP64 reference; bf16 bounds scale with that tensor's
    max|ref| (the engine's ``gemm.<check>.bf16`` form), fp32 uses ``ops.timestep_embed_mlp[_grad]``."""
    skip_unless_compiled(target)
    p = _params(QWEN_C, QWEN_D, target)
    kw = dict(channels=QWEN_C, scale=1000.0)
    gy = randn(SIGMAS.shape[0], QWEN_D, gen=generator(6), target=target)

    def rf(s, *q):
        return ref.timestep_embed_mlp(s, *q, **kw)

    ref_in = [target.put(t).detach().to("cpu", torch.float64) for t in (SIGMAS, *p)]
    ref_out, ref_grads = run_with_grads(rf, ref_in, gy.detach().to("cpu", torch.float64), [1, 2, 3, 4])
    for i, check in zip((1, 2, 3, 4), ("dW", "db", "dW", "db")):
        tol = _tol(target) if target.dtype == torch.float32 else {
            "fwd": gemm_tolerance("forward", target.dtype, ref_out), "grad": gemm_tolerance(check, target.dtype, ref_grads[i])}
        check_grad_accuracy(lambda s, *q: E.timestep_embed_mlp(s.float(), *q, **kw), rf, [SIGMAS, *p], tol, target=target,
                            grad_out=gy, wrt=[i], what=f"triton timestep_embed_mlp {target.label} grad {i}")


@pytest.mark.gpu
def test_gpu_fp32_param_grad_fold():
    target = GPU_TARGETS[1]
    skip_unless_compiled(target)
    p = _params(QWEN_C, QWEN_D, target)
    gen = generator(5)
    items = [torch.rand(1, generator=gen).cuda() for _ in range(5)]
    gouts = [randn(1, QWEN_D, gen=gen, target=target) for _ in range(5)]
    check_param_grad_fold(lambda bt, q: list(E.timestep_embed_mlp(torch.cat(bt), *q, channels=QWEN_C, scale=1000.0).split(1)),
                          items, p, gouts, what="triton timestep_embed_mlp fp32 dW1/db1/dW2/db2")
