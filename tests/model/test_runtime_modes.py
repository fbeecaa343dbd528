"""Runtime modes (docs/design.md §4): strict fails closed, auto records fallbacks, audit records drift
without changing results, off is the production path; the trace records the arithmetic policy; bad
forward inputs raise ValueError with a clear message."""

from __future__ import annotations

import json

import pytest
import torch

from mmdit_strict import MMDiT
from mmdit_strict.kernels import NoStrictKernelError, Runtime, capture_trace, resolve
from tests.harness import BadCase, assert_bytes_equal, check_bad_inputs
from tests.helpers import make_inputs


@pytest.fixture(scope="module")
def fp32_model(tiny_ckpt):
    return MMDiT.from_pretrained(tiny_ckpt[0], runtime="strict")


@pytest.fixture(scope="module")
def bf16_model(tiny_ckpt):
    return MMDiT.from_pretrained(tiny_ckpt[0], runtime="strict", dtype=torch.bfloat16)


def _run(model: MMDiT, runtime: str, inputs: dict) -> torch.Tensor:
    model.set_runtime(runtime)
    with torch.no_grad():
        return model(**inputs).sample


# ------------------------------------------------------------------------------------------ fail closed


def test_strict_without_qualified_kernel_fails_closed(bf16_model):
    inputs = make_inputs(2, (4, 4), [5, 9], dtype=torch.bfloat16)
    with pytest.raises(NoStrictKernelError) as info:
        _run(bf16_model, "strict", inputs)
    msg = str(info.value)
    assert "device=cpu" in msg and "dtype=bf16" in msg, msg
    assert "timestep_embed_mlp" in msg, f"the first operator of the forward should be named: {msg}"
    assert "runtime=auto" in msg, "the message should say how to proceed"


def test_audit_without_qualified_kernel_also_fails_closed(bf16_model):
    with pytest.raises(NoStrictKernelError):
        _run(bf16_model, "audit", make_inputs(1, (4, 4), [5], dtype=torch.bfloat16))


@pytest.mark.parametrize("op", ["qkv_bias_gemm", "joint_attention_fused", "multi_axis_rope", "final_adaln_out"])
def test_resolve_names_each_operator(op):
    with pytest.raises(NoStrictKernelError, match=f"'{op}'.*device=cpu dtype=bf16"):
        resolve(op, "cpu", torch.bfloat16, Runtime.STRICT)
    impl, fell_back = resolve(op, "cpu", torch.bfloat16, Runtime.AUTO)
    assert fell_back and impl.backend == "torch" and not impl.strict
    impl, fell_back = resolve(op, "cpu", torch.float32, Runtime.STRICT)
    assert not fell_back and impl.backend == "cpu_strict" and impl.strict


# ---------------------------------------------------------------------------------------------- auto


def test_auto_falls_back_and_trace_records_it(bf16_model, tmp_path):
    inputs = make_inputs(2, (4, 4), [5, 9], dtype=torch.bfloat16)
    with capture_trace() as trace:
        out = _run(bf16_model, "auto", inputs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert trace.fallbacks, "auto on CPU bf16 must record fallbacks"
    ops = {r.op for r in trace.fallbacks}
    assert {"timestep_embed_mlp", "qkv_bias_gemm", "joint_attention_fused", "final_adaln_out"} <= ops, ops
    for r in trace.records.values():
        assert r.fallback and r.actual_backend == "torch" and r.requested == "auto" and r.dtype == "bf16"
    path = tmp_path / "trace.json"
    trace.dump(path)
    dumped = json.loads(path.read_text())
    assert dumped["fallbacks"] == len(trace.fallbacks)
    assert {o["op"] for o in dumped["operators"] if o["fallback"]} == ops
    assert any("timestep_embed_mlp:cpu/bf16->torch" == f for f in trace.summary()["fallbacks"])


def test_auto_on_qualified_dtype_is_strict(fp32_model):
    inputs = make_inputs(2, (4, 4), [5, 9])
    with capture_trace() as trace:
        auto = _run(fp32_model, "auto", inputs)
    strict = _run(fp32_model, "strict", inputs)
    assert not trace.fallbacks
    assert {r.actual_backend for r in trace.records.values()} == {"cpu_strict"}
    assert_bytes_equal(auto, strict, "auto (everything qualified) vs strict")


# ------------------------------------------------------------------------------------- strict & trace


def test_strict_trace_records_policy_and_kernels(fp32_model, tmp_path):
    inputs = make_inputs(2, (4, 6), [5, 9])
    before = torch.are_deterministic_algorithms_enabled()
    with capture_trace() as trace:
        _run(fp32_model, "strict", inputs)
    assert torch.are_deterministic_algorithms_enabled() == before, "strict_math must restore the global policy"
    assert torch.utils.deterministic.fill_uninitialized_memory is True, "strict_math must restore the fill switch"
    d = trace.to_dict()
    assert d["policy"]["deterministic_algorithms"] is True, d["policy"]
    assert d["policy"]["cuda_matmul_allow_tf32"] is False and d["policy"]["cudnn_allow_tf32"] is False, d["policy"]
    assert d["policy"]["float32_matmul_precision"] == "highest"
    assert d["policy"]["fill_uninitialized_memory"] is False, "strict blocks skip the NaN fill of torch.empty"
    assert d["fallbacks"] == 0
    expected_ops = {
        "timestep_embed_mlp", "latent_proj_gemm", "txt_in_rmsnorm_linear", "adaln_mod_projection", "adaln_modulation",
        "qkv_bias_gemm", "qk_rmsnorm", "multi_axis_rope", "joint_attention_fused", "attn_out_bias_gemm",
        "adaln_gate_residual", "mlp_up_gemm_gelu", "mlp_down_gemm", "final_adaln_out",
    }
    assert {o["op"] for o in d["operators"]} == expected_ops
    for o in d["operators"]:
        k = o["kernel"]
        assert o["requested"] == "strict" and o["actual_backend"] == "cpu_strict" and not o["fallback"]
        assert k["strict"] is True and k["split_k"] is False and k["accumulator"] == "fp32"
        assert len(k["source_sha256"]) == 16 and k["reduction_order"], k
    layers = fp32_model.config.num_layers
    calls = {o["op"]: o["calls"] for o in d["operators"]}
    assert calls["qkv_bias_gemm"] == 6 * layers and calls["joint_attention_fused"] == layers and calls["latent_proj_gemm"] == 2
    trace.dump(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["policy"]["deterministic_algorithms"] is True


def test_strict_never_uses_production_kernels(fp32_model):
    with capture_trace() as trace:
        _run(fp32_model, "strict", make_inputs(1, (4, 4), [3]))
    assert all(r.kernel["strict"] for r in trace.records.values())


# ---------------------------------------------------------------------------------------------- audit


def test_audit_returns_strict_bytes_and_records_drift(fp32_model):
    inputs = make_inputs(3, (4, 6), [5, 9, 2], pad_to=11)
    strict = _run(fp32_model, "strict", inputs)
    prod = _run(fp32_model, "off", inputs)
    fp32_model.audit_records.clear()
    audit = _run(fp32_model, "audit", inputs)
    assert_bytes_equal(audit, strict, "audit result vs strict result")
    assert len(fp32_model.audit_records) == 1
    rec = fp32_model.audit_records[0]
    drift = float((prod.double() - strict.double()).abs().max())
    assert rec["max_abs_drift"] == pytest.approx(drift, rel=1e-6, abs=0.0), (rec, drift)
    assert rec["byte_equal"] is torch.equal(prod, strict)
    assert drift > 0, "production and strict happen to agree in bytes here; pick other inputs"


# ------------------------------------------------------------------------------------------------ off


def test_off_is_the_production_path(fp32_model):
    inputs = make_inputs(2, (4, 6), [5, 9])
    with capture_trace() as trace:
        off = _run(fp32_model, "off", inputs)
    validated = fp32_model.validate_inputs(**{k: inputs[k] for k in (
        "hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "img_shapes")})
    with torch.no_grad():
        assert_bytes_equal(off, fp32_model.production_forward(validated), "runtime off vs production_forward")
    assert all(r.actual_backend == "torch" and not r.fallback for r in trace.records.values()), trace.summary()
    assert not torch.equal(off, _run(fp32_model, "strict", inputs)), "strict and production should differ in bytes here"


def test_runtime_parse_errors():
    with pytest.raises(ValueError, match="unknown runtime 'fast'.*strict"):
        Runtime.parse("fast")


# ----------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("runtime", ["off", "strict"])
def test_bad_forward_inputs(fp32_model, runtime):
    fp32_model.set_runtime(runtime)
    good = make_inputs(2, (4, 4), [3, 5], pad_to=6)
    hs, ehs, mask = good["hidden_states"], good["encoder_hidden_states"], good["encoder_hidden_states_mask"]
    nan_hs = hs.clone()
    nan_hs[1, 3, 7] = float("nan")
    inf_ehs = ehs.clone()
    inf_ehs[0, 0, 0] = float("inf")
    holey = mask.clone()
    holey[1, 1] = 0  # 1 0 1 1 1 0: not a prefix
    empty = mask.clone()
    empty[0] = 0
    two_valued = mask.clone()
    two_valued[0, 0] = 2

    def kw(**over):
        return {**good, **over}

    check_bad_inputs(lambda **k: fp32_model(**k), [
        BadCase("2-d hidden_states", (), kw(hidden_states=hs[0]), "hidden_states must be a (B, image_tokens, 64)"),
        BadCase("channels", (), kw(hidden_states=hs[..., :60]), "64 channels"),
        # a batch of 1 is broadcast (diffusers' single negative prompt); any other mismatch is refused
        BadCase("ehs batch", (), kw(encoder_hidden_states=torch.cat([ehs, ehs[:1]])), "encoder_hidden_states of shape (2, L, 48)"),
        BadCase("ehs width", (), kw(encoder_hidden_states=ehs[..., :40]), "(2, L, 48)"),
        BadCase("dtype mismatch", (), kw(hidden_states=hs.double()), "dtype torch.float64"),
        BadCase("bf16 text", (), kw(encoder_hidden_states=ehs.bfloat16()), "cast the input"),
        BadCase("NaN latents", (), kw(hidden_states=nan_hs), "NaN or Inf"),
        BadCase("Inf prompt", (), kw(encoder_hidden_states=inf_ehs), "NaN or Inf"),
        BadCase("mask shape", (), kw(encoder_hidden_states_mask=mask[:, :4]), "mask must have shape (2, 6)"),
        BadCase("non-prefix mask", (), kw(encoder_hidden_states_mask=holey), "prefix mask"),
        BadCase("all-zero mask row", (), kw(encoder_hidden_states_mask=empty), "at least one valid text token"),
        BadCase("mask values", (), kw(encoder_hidden_states_mask=two_valued), "only 0 and 1"),
        BadCase("NaN float mask", (), kw(encoder_hidden_states_mask=mask.float().masked_fill(mask == 0, float("nan"))),
                "mask contains NaN or Inf"),
        BadCase("timestep above 1", (), kw(timestep=torch.tensor([0.5, 1.5])), "sigmas in [0, 1]"),
        BadCase("timestep shape", (), kw(timestep=torch.zeros(3)), "timestep must be a scalar or a (2,)"),
        BadCase("NaN timestep", (), kw(timestep=torch.tensor([0.5, float("nan")])), "finite"),
        BadCase("integer timestep", (), kw(timestep=torch.tensor([1, 0])), "floating-point sigmas"),
        BadCase("img_shapes tokens", (), kw(img_shapes=[[(1, 4, 5)]] * 2), "describe 20 tokens but hidden_states has 16"),
        BadCase("img_shapes count", (), kw(img_shapes=[[(1, 4, 4)]] * 3), "one list of (f, h, w) per sample"),
        BadCase("img_shapes missing", (), kw(img_shapes=None), "img_shapes is required"),
        BadCase("guidance", (), kw(guidance=torch.ones(2)), "guidance"),
        BadCase("unknown argument", (), kw(controlnet_block_samples=[torch.ones(1)]), "unsupported forward arguments"),
        BadCase("no timestep", (), kw(timestep=None), "required"),
    ])
    fp32_model.set_runtime("strict")
