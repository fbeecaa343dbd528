"""The peer survey (mmdit_strict/bench/peers) on the CPU at tiny shapes: its adapters run (PyTorch deterministic,
SDPA, and Megatron-Core's matmul under the Triton interpreter where installed), its checks count what they claim, a
deliberately batch-dependent implementation is flagged, and the report has a row for every implementation."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from mmdit_strict.bench.peers import liger, megatron, ours, sdpa, torch_det
from mmdit_strict.bench.peers.cases import TINY, cases
from mmdit_strict.bench.peers.harness import InvariancePlan, accuracy, invariance
from mmdit_strict.bench.peers.impl import Impl, Missing
from mmdit_strict.bench.peers.plans import profile
from mmdit_strict.bench.peers.report import render
from mmdit_strict.bench.peers.survey import NOT_RUN, check_names, survey

F32 = torch.float32
PLAN = InvariancePlan((5,), ((1, 4),), (2, 3), (0, 3))


def _case(op: str):
    return next(c for c in cases(TINY) if c.op == op)


def _draw(case):
    return lambda sizes, key: case.sample(sizes, torch.Generator().manual_seed(key), F32)


def _shared(case):
    return case.shared(torch.Generator().manual_seed(3), F32)


def _ours(case):
    (impl,) = ours.implementations([case], "cpu", F32)
    assert isinstance(impl, Impl), impl
    return impl


def _batch_dependent(case):
    """A toy peer: ours plus an offset that grows with the batch size (what a batch-shape-dependent reduction does)."""
    base = _ours(case)

    def fn(*args, seqlens):
        outs = base.fn(*args, seqlens=seqlens)
        return tuple(o + 1e-6 * (len(seqlens[0]) - 1) for o in outs)

    return Impl("toy", "toy-batch-dependent", case.op, fn, "ours + 1e-6·(B − 1)")


def test_bad_names_are_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown peer.*torch-deterministic.*not run here.*vllm"):
        check_names(["vllm"], ["norms"])
    with pytest.raises(ValueError, match="unknown family.*projection"):
        check_names(["ours"], ["layernorm"])
    with pytest.raises(ValueError, match="unknown famil"):
        cases(TINY, ["nope"])
    with pytest.raises(ValueError, match="unknown profile"):
        profile("huge")
    assert set(NOT_RUN) == {"vllm", "sglang", "flash-attn"}


def test_invariance_counts_every_record_and_flags_a_batch_dependent_peer() -> None:
    case = _case("adaln_gate_residual")
    draw, shared = _draw(case), _shared(case)
    good = invariance(case, _ours(case), F32, PLAN, shared, draw, seed=5)
    bad = invariance(case, _batch_dependent(case), F32, PLAN, shared, draw, seed=5)
    # B = 2: the probe at positions {0, 1}, both samples compared; B = 3: positions {0, 1, 2}, three samples each;
    # two padding growths, the probe compared; each comparison is four tensors: out, dx, dy, dgate
    records = (2 * 2 + 3 * 3 + 2) * 4
    assert good["checked"] == bad["checked"] == records
    assert good["failing"] == 0 and good["equal"] == records
    # every output of a sample in a batch of B > 1 differs; its gradients do not (the offset has none)
    assert bad["failing"] == 2 * 2 + 3 * 3 + 2 and bad["failures"]


def test_torch_deterministic_and_sdpa_run_and_are_judged() -> None:
    att = _case("joint_attention_fused")
    plan = InvariancePlan((2, 5), ((0, 3), (1, 4)), (2,), (3,), pad_stream=0)
    impls = [i for i in torch_det.implementations([att], "cpu", F32) + sdpa.implementations([att], "cpu", F32)]
    ran = [i for i in impls if isinstance(i, Impl)]
    assert [i.name for i in ran] == ["torch-deterministic", "sdpa-math", "sdpa-flash"]
    assert {i.name for i in impls if isinstance(i, Missing)} == {"sdpa-efficient", "sdpa-cudnn"}
    for impl in ran:
        res = invariance(att, impl, F32, plan, (), _draw(att), seed=2)
        assert res["checked"] == (2 * 2 + 1) * 8 and res["equal"] + res["failing"] == res["checked"]
    samples = [_draw(att)((3, 6), 77)]
    acc = accuracy(att, [_ours(att), *ran], "fp32", samples, (), seed=4)
    for name, rows in acc.items():
        assert [r["tensor"] for r in rows] == ["out0", "out1", "dq_txt", "dk_txt", "dv_txt", "dq_img", "dk_img", "dv_img"]
        assert all(r["pass"] and r["bound_ratio"] <= 1 for r in rows), (name, rows)


def test_accuracy_flags_an_implementation_off_by_more_than_the_contract() -> None:
    case = _case("adaln_modulation")
    base = _ours(case)
    off = Impl("toy", "toy-off", case.op, lambda *a, seqlens: tuple(o * (1 + 1e-3) for o in base.fn(*a, seqlens=seqlens)), "1e-3 relative")
    acc = accuracy(case, [base, off], "fp32", [_draw(case)((7,), 1)], (), seed=1)
    assert all(r["pass"] for r in acc["ours"])
    assert not acc["toy-off"][0]["pass"] and acc["toy-off"][0]["bound_ratio"] > 1


def test_survey_report_has_a_row_per_implementation_and_counts_failures() -> None:
    prof = replace(profile("tiny"), rows=replace(profile("tiny").rows, invariance=PLAN, accuracy=(((6,), 2),),
                                                 speed={"small": ((5,), 1), "large": ((5,), 2)}))
    toy = _batch_dependent(_case("adaln_gate_residual"))
    rep = survey(prof, ["norms"], ["ours", "torch-deterministic", "liger-kernel"], "cpu", extra_impls=[toy])
    rep = json.loads(json.dumps(rep))  # the report is JSON as written
    md = render({**rep, "env": {"cpu": "test", "torch": torch.__version__}})
    names = {(i["op"], i["name"]) for i in rep["implementations"] if "note" in i}
    assert names == {("adaln_modulation", "ours"), ("adaln_modulation", "torch-deterministic"),
                     ("adaln_gate_residual", "ours"), ("adaln_gate_residual", "torch-deterministic"),
                     ("adaln_gate_residual", "toy-batch-dependent")}
    for op, name in names:
        assert f"| {name} | {op} | fp32 |" in md
    toy_inv = next(r for r in rep["invariance"] if r["name"] == "toy-batch-dependent")
    assert toy_inv["failing"] > 0 and f"| toy-batch-dependent | adaln_gate_residual | fp32 | **{toy_inv['failing']}**/" in md
    assert all(r["failing"] == 0 for r in rep["invariance"] if r["name"] == "ours")
    assert all(r["failing"] == 0 and r["tensors"] for r in rep["accuracy"] if r["name"] == "ours")
    assert {r["size"] for r in rep["speed"]} == {"small", "large"} and all(r.get("fwd_bwd_ms") for r in rep["speed"])
    assert "liger-kernel" in md and "not run:" in md and "**vllm**" in md and "**flash-attn**" in md


def test_cli_bench_peers_writes_json_and_markdown(tmp_path) -> None:
    from mmdit_strict.cli.main import main

    rc = main(["bench", "peers", "--out", str(tmp_path), "--families", "norms", "--peers", "torch-deterministic",
               "--profile", "tiny"])  # the tiny record set on every machine (a GPU would default to full)
    assert rc == 0
    rep = json.loads((tmp_path / "peers.json").read_text())
    assert rep["profile"] == "tiny" and rep["invariance"] and (tmp_path / "peers.md").read_text().startswith("# Batch-invariant peers")
    assert main(["bench", "gemm", "--quick", "--out", str(tmp_path)]) == 2  # a peers-only flag elsewhere is bad input


def test_liger_adapter_names_its_kernels() -> None:
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (the bench extra)")
    fam = cases(TINY, ["norms", "qk_norm_rope"])
    assert all(isinstance(i, Missing) and "CUDA" in i.reason for i in liger.implementations(fam, "cpu", F32)
               if i.op != "adaln_gate_residual")
    on_gpu = liger.implementations(fam, "cuda", F32)  # builds the adapters: Liger's functions must import
    assert [type(i).__name__ for i in on_gpu] == ["Impl", "Missing", "Impl"]


def test_megatron_matmul_runs_alone_from_the_installed_file() -> None:
    if megatron.module_path() is None:
        pytest.skip("megatron-core is not installed (the bench extra)")
    import sys

    megatron.load()
    assert "megatron.core" not in sys.modules  # the module alone, not the package
    case = _case("qkv_bias_gemm")
    (impl,) = megatron.implementations([case], "cpu", F32)
    if isinstance(impl, Missing):
        pytest.skip(impl.reason)
    res = invariance(case, impl, F32, InvariancePlan((3,), ((1, 3),), (2,)), _shared(case), _draw(case), seed=1)
    # (B = 2: 2 positions x 2 samples) x (out, dx); dW and db are shared, so not per-sample records
    assert res["checked"] == 2 * 2 * 2 and res["equal"] + res["failing"] == res["checked"]
    acc = accuracy(case, [impl], "fp32", [_draw(case)((4,), 9)], _shared(case), seed=1)
    assert all(r["pass"] for r in acc[impl.name])
