"""The GEMM classes the strict model runs, read from a strict forward (not from a hand-kept list).

A one-block model of the architecture runs its strict forward at the requested batch layouts under
:func:`~mmdit_strict.model.strict.record_gemms`; every product handed to the GEMM engine is grouped
into a class by the layer it belongs to, with the row counts seen. One block is enough: every block
runs the same products.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..config.arch import ArchConfig
from ..model.inputs import random_inputs
from ..model.strict import GemmCall, record_gemms

#: (name, N, K, bias, prologue, epilogue, row counts): one GEMM class of the model
Layer = tuple[str, int, int, bool, str, str, tuple[int, ...]]

# Benchmark names of the GEMM-family operators (the report's historical row names).
_NAMES = {
    "qkv_bias_gemm": "qkv", "attn_out_bias_gemm": "attn_out", "mlp_up_gemm_gelu": "mlp_up",
    "mlp_down_gemm": "mlp_down", "adaln_mod_projection": "mod", "final_adaln_out": "final_mod",
    "txt_in_rmsnorm_linear": "txt_in",
}


def layer_name(call: GemmCall) -> str:
    """The class a product belongs to: the operator's bench name, or its site for the latent / timestep linears."""
    if call.op in ("latent_proj_gemm", "timestep_embed_mlp"):
        return call.where  # img_in / proj_out, temb_1 / temb_2
    return _NAMES.get(call.op, call.op)


def model_gemm_layers(
    arch: ArchConfig,
    layouts: Sequence[tuple[tuple[int, int], Sequence[int]]] = (((64, 64), (128,)),),
    *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
) -> list[Layer]:
    """Every GEMM class of ``arch``'s strict forward, in first-run order.

    ``layouts``: (latent grid, valid prompt tokens per sample) of each recorded forward; the row counts
    of a class are those its products saw over all of them (image rows, text rows or one per sample).
    Raises ValueError if one class name is met with two weight shapes.
    """
    from ..model.init import build_model

    model = build_model(dataclasses.replace(arch, num_layers=1), seed=0, runtime="strict", dtype=dtype, device=device)
    with record_gemms() as calls, torch.no_grad():
        for grid, txt_lens in layouts:
            inp = {k: (v.to(device).to(dtype) if v.is_floating_point() and k != "timestep" else v.to(device))
                   if isinstance(v, torch.Tensor) else v for k, v in random_inputs(arch, grid, list(txt_lens)).items()}
            model(**inp)
    classes: dict[str, tuple[tuple, set[int]]] = {}
    for c in calls:
        name = layer_name(c)
        key = (c.n, c.k, c.bias, c.prologue, c.epilogue)
        seen = classes.setdefault(name, (key, set()))
        if seen[0] != key:
            raise ValueError(f"GEMM class {name} runs two shapes: {seen[0]} and {key}")
        seen[1].add(c.rows)
    return [(name, *key, tuple(sorted(rows))) for name, (key, rows) in classes.items()]
