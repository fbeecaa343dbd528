"""benchmarks.lora_regs_sass builds the GEMM main kernel offline from launch arguments of its own: they must be the
ones the engine plans for the same call (interpreter, where the plan takes tensor descriptors as on the GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.lora_regs_sass import RANK, _case
from mmdit_strict.kernels.triton import configs as C
from mmdit_strict.kernels.triton.gemm import kernels as K
from mmdit_strict.kernels.triton.gemm import launch as L
from mmdit_strict.kernels.triton.gemm.codes import Act
from tests.kernels.triton_rows import interp


@interp
@pytest.mark.parametrize("k,n,epilogue", [(3072, 3072, Act.NONE), (3072, 12288, Act.GELU_TANH), (12288, 3072, Act.NONE)])
def test_the_probe_builds_the_specialization_the_engine_plans(k: int, n: int, epilogue: Act) -> None:
    for stream, dx, lora in itertools.product(("image", "text"), (False, True), (False, True)):
        args, kw, cfg = _case(torch, C, K, TensorDescriptor, k, n, int(epilogue), dx, lora, None, stream)
        a, m, nn, kk = args[0].base, args[6], args[7], args[8]
        w = args[1].base
        b = L.Operand(w, (1, kk), nk=True) if kw["CFG"].W_NK else L.Operand(w, (nn, 1))
        u = torch.empty(m, RANK, dtype=torch.bfloat16)
        lo = L.Lora(u, torch.empty(RANK, nn, dtype=torch.bfloat16), (nn, 1), 1.0) if lora else None
        out = torch.empty(m, nn, dtype=torch.bfloat16)
        plan = L._plan(("probe-test", stream, dx, lora), a, b, nn, cfg, Act.NONE, 0 if dx else int(epilogue), not dx, lo,
                       bool(epilogue) and not dx, out)
        want = plan.kw["CFG"]._replace(NUM_PROGRAMS=0)
        got = kw["CFG"]._replace(NUM_PROGRAMS=0)  # the probe builds for the H200's 132 SMs, the interpreter runs 3
        assert got == want, f"{stream} {k} → {n} dx={dx} lora={lora}"
        assert (kw["num_warps"], kw["num_stages"]) == (cfg.num_warps, cfg.num_stages)  # the engine's options (the
        # interpreter's plan carries none) come from the same configuration
        assert cfg == C.fwd_config(k if dx else n, n if dx else k, torch.bfloat16, stream)
