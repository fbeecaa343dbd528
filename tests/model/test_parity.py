"""Production (runtime off), strict and the FP64 reference against diffusers on the tiny checkpoint.

Every check reports its max relative error (normalised by the largest |expected| of the output, so
near-zero outputs do not dominate) in the assertion message; bounds come from ``tolerances.yaml``.
"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict import MMDiT
from mmdit_strict.tolerances import Tolerance, tolerance
from tests.helpers import make_inputs

# (batch, grid, text lengths, padded length): B=1, B=3 with different mask lengths + padding, a
# non-square grid, and the three reference aspect ratios (1024², 1328², 1664×928) scaled down.
CASES = {
    "b1": (1, (8, 8), [11], None),
    "b3_masks_padded": (3, (6, 6), [3, 17, 9], 21),
    "non_square": (2, (4, 10), [5, 12], 14),
    "ref_1024sq": (1, (8, 8), [13], 16),
    "ref_1328sq": (1, (9, 9), [13], 16),
    "ref_1664x928": (2, (13, 7), [13, 6], 16),
}


def _errors(tol: Tolerance, actual: torch.Tensor, expected: torch.Tensor) -> tuple[bool, str]:
    passed, max_abs, _ = tol.check(actual, expected)
    scale = float(expected.detach().double().abs().max())
    return passed, f"max abs {max_abs:.3e}, max rel (to max|expected| {scale:.2f}) {max_abs / scale:.3e}"


@pytest.fixture(scope="module")
def models(tiny_ckpt):
    path, diffusers_model = tiny_ckpt
    ours = MMDiT.from_pretrained(path, runtime="off")
    return ours, diffusers_model


def _run(model, inputs, runtime: str | None = None) -> torch.Tensor:
    if runtime is not None:
        model.set_runtime(runtime)
    with torch.no_grad():
        return model(**inputs).sample


@pytest.mark.parametrize("case", list(CASES))
def test_production_and_strict_match_diffusers(models, case):
    ours, ref_model = models
    batch, grid, lens, pad = CASES[case]
    inputs = make_inputs(batch, grid, lens, pad_to=pad, seed=7, sigma=[0.9, 0.35, 0.05][:batch] if batch > 1 else 0.6)
    expected = _run(ref_model, inputs)
    prod = _run(ours, inputs, "off")
    strict = _run(ours, inputs, "strict")
    ours.set_runtime("off")

    ok, msg = _errors(tolerance("model", "production_vs_diffusers", "fp32"), prod, expected)
    assert ok, f"[{case}] production vs diffusers: {msg}"
    ok, msg = _errors(tolerance("model", "strict_vs_production", "fp32"), strict, prod)
    assert ok, f"[{case}] strict vs production: {msg}"
    ok, msg = _errors(tolerance("model", "strict_vs_diffusers", "fp32"), strict, expected)
    assert ok, f"[{case}] strict vs diffusers: {msg}"


def test_unmasked_and_all_valid_mask_agree(models):
    """No mask and an all-ones mask are the same request (diffusers and ours)."""
    ours, ref_model = models
    inputs = make_inputs(2, (4, 6), [9, 9], seed=3)
    no_mask = dict(inputs, encoder_hidden_states_mask=None)
    for rt in ("off", "strict"):
        a, b = _run(ours, inputs, rt), _run(ours, no_mask, rt)
        assert torch.equal(a, b), f"runtime {rt}: all-ones mask and no mask differ"
    ours.set_runtime("off")
    ok, msg = _errors(tolerance("model", "production_vs_diffusers", "fp32"), _run(ours, no_mask), _run(ref_model, no_mask))
    assert ok, f"no mask, production vs diffusers: {msg}"


def test_pipeline_style_img_shapes(models):
    """diffusers' pipeline passes ``[[(1, h, w)]] * B``; a bare (1, h, w) means the same for every sample."""
    ours, _ = models
    inputs = make_inputs(2, (6, 4), [5, 8], seed=5)
    a = _run(ours, inputs, "off")
    b = _run(ours, dict(inputs, img_shapes=(1, 6, 4)), "off")
    assert torch.equal(a, b)


def test_fp64_reference_matches_diffusers_and_ours(models):
    """The independent FP64 reference vs diffusers (FP64 as shipped, FP32) and vs our two runtimes."""
    model_mod = pytest.importorskip("mmdit_strict.reference.model")
    ours, ref_model = models
    inputs = make_inputs(3, (13, 7), [4, 13, 9], pad_to=15, seed=11, sigma=[0.95, 0.5, 0.1])
    ref64 = model_mod.reference_forward(
        ours.state_dict(), ours.config, inputs["hidden_states"], inputs["encoder_hidden_states"],
        inputs["encoder_hidden_states_mask"], inputs["timestep"], inputs["img_shapes"],
    )
    d64 = ref_model.to(torch.float64)
    try:
        inputs64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inputs.items()}
        with torch.no_grad():
            out_d64 = d64(**inputs64).sample
    finally:
        ref_model.to(torch.float32)
    ok, msg = _errors(tolerance("reference", "model_vs_diffusers_fp64_as_shipped", "fp64"), out_d64, ref64)
    assert ok, f"diffusers FP64 (as shipped) vs FP64 reference: {msg}"
    ok, msg = _errors(tolerance("reference", "model_vs_diffusers", "fp32"), _run(ref_model, inputs), ref64)
    assert ok, f"diffusers FP32 vs FP64 reference: {msg}"
    ok, msg = _errors(tolerance("model", "production_vs_reference", "fp32"), _run(ours, inputs, "off"), ref64)
    assert ok, f"production FP32 vs FP64 reference: {msg}"
    ok, msg = _errors(tolerance("model", "strict_vs_reference", "fp32"), _run(ours, inputs, "strict"), ref64)
    ours.set_runtime("off")
    assert ok, f"strict FP32 vs FP64 reference: {msg}"


def test_block_error_curve(models, tmp_path):
    """The per-stage error curve lines the three forwards up and ends within the model tolerances."""
    pytest.importorskip("mmdit_strict.reference.model")
    from mmdit_strict.analysis.block_error import block_error_curve, write_block_error

    ours, _ = models
    inputs = make_inputs(2, (4, 6), [3, 9], pad_to=12, seed=4, sigma=[0.8, 0.3])
    result = block_error_curve(ours, inputs)
    layers = ours.config.num_layers
    assert result["stages"][:3] == ["temb", "img_in", "txt_in"] and result["stages"][-2:] == ["norm_out", "output"]
    assert len(result["stages"]) == 3 + 2 * layers + 2
    s_vs_p = {r["stage"]: r for r in result["pairs"]["strict_vs_production"]}
    assert s_vs_p["img_in"]["byte_equal"] and s_vs_p["txt_in"]["byte_equal"], "the input projections share one GEMM tree here"
    final = result["pairs"]["strict_vs_reference"][-1]
    assert final["stage"] == "output" and final["max_abs"] <= tolerance("model", "strict_vs_reference", "fp32").atol + \
        tolerance("model", "strict_vs_reference", "fp32").rtol * final["max_abs_ref"], final
    paths = write_block_error(result, tmp_path, png=False)
    assert paths["json"].exists() and "png" not in paths
