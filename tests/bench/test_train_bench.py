"""`mmdit-strict bench train` on the CPU at tiny size: both engines run every phase of one Flow-GRPO update,
the report has their figures and ratios, and our recomputed logp is the rollout's to the byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmdit_strict.bench import train as train_bench
from mmdit_strict.cli.main import main as cli_main


@pytest.mark.slow
def test_bench_train_writes_every_phase_of_both_engines(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # 3 steps, a window of 2: 4 pairs in micro-batches of 3 and 1 (the CPU default is 10 steps and micro-batches of 2)
    assert train_bench.main(["--out", str(out), "--device", "cpu", "--steps", "3", "--micro-batch", "3"]) == 0
    report = json.loads((out / "train_bench.json").read_text())
    c = report["config"]
    assert (c["arch"], c["device"], c["group"], c["steps"], c["window"], c["micro_batch"]) == ("tiny", "cpu", 2, 3, 2, 3)
    assert report["errors"] == [] and set(report["engines"]) == {"ours", "diffusers_peft"}
    for name, e in report["engines"].items():
        assert list(e["phases"]) == list(train_bench.PHASES), name
        for r in [*e["phases"].values(), e["total"]]:
            assert r["wall_s"] > 0 and r["peak_gib"] is None and r["launches"] is None and r["gpu_busy"] is None
        assert e["total"]["wall_s"] == pytest.approx(sum(r["wall_s"] for r in e["phases"].values()))
        assert (e["pairs"], e["micro_batches"]) == (4, 2)
    ours, theirs = report["engines"]["ours"], report["engines"]["diffusers_peft"]
    # the honesty check: the first update recomputes the rollout's logp bytes, so every ratio is exactly 1
    assert ours["first_update_ratio_exact_one"] is True and ours["first_update_logp_bytes_differ"] == 0
    assert all(u["logp_bytes_differ"] == 0 and u["ratio_exact_one_frac"] == 1.0 for u in ours["checks_every_update"])
    assert len(ours["checks_every_update"]) == 2  # the warm-up update and the timed one
    assert ours["runtime"] == "strict" and theirs["runtime"] == "off"
    held = ours["held_after_train"]  # what the sink held; on the CPU no captured steps
    assert held["lora_fp32_gib"] > 0 and held["sink_peak_nodes_per_param"] >= 1 and held["sink_peak_pending_gib"] > 0
    assert held["train_graph_pools"] is None and theirs["held_after_train"] == {}
    assert held["sink_group_tensors"] == 0  # no captured steps on the CPU: every tensor folded alone
    assert ours["train_memory_trace"] == [] and ours["train_peak_reached"] is None  # CUDA's allocator counters only
    assert "| ours | " in (out / "train_bench.md").read_text().split("What the grad sink")[1]
    for phase in [*train_bench.PHASES, "total"]:
        want = ours["phases"][phase]["wall_s"] if phase != "total" else ours["total"]["wall_s"]
        base = theirs["phases"][phase]["wall_s"] if phase != "total" else theirs["total"]["wall_s"]
        assert report["ratios"][phase]["wall_s"] == pytest.approx(want / base)
        assert report["ratios"][phase]["peak_gib"] is None
    md = (out / "train_bench.md").read_text()
    assert md.splitlines()[2].startswith("CPU ") and report["environment"]["commit"]
    for name in ("ours", "diffusers_peft"):
        for phase in [*train_bench.PHASES, "total"]:
            assert f"| {name} | {phase} |" in md
    assert "| ours | 0 | 4 | yes |" in md and "## Errors" not in md
    assert "allocated peak" not in md  # no trace on the CPU
    assert (out / "train_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ours["train_memory_trace"] = [{"at": "forward", "micro_batch": 0, "peak_so_far_gib": 9.5, "allocated_gib": 9.0,
                                   "captures": 1}, {"at": "backward", "micro_batch": 0, "peak_so_far_gib": 9.75,
                                                    "allocated_gib": 9.25, "captures": 2}]
    ours["train_peak_reached"] = train_bench.peak_reached(ours["train_memory_trace"])
    assert "| ours | 0 of 2 | backward | 9.75 | 9.25 | 2 | 2 |" in train_bench.render(report)


def test_bench_train_with_two_prompts_runs_both_groups_on_policy(tmp_path: Path) -> None:
    """``--prompts 2``: two groups of prompts of different lengths (the layouts an epoch of ``train`` meets), every
    pair of both groups trained, our first update still exactly on-policy."""
    out = tmp_path / "out"
    assert train_bench.main(["--out", str(out), "--device", "cpu", "--steps", "2", "--window", "1", "--prompts", "2",
                             "--warmup", "1", "--txt", "9", "--fresh-prompts"]) == 0
    report = json.loads((out / "train_bench.json").read_text())
    c = report["config"]
    # timed and profiled (spare) updates, then the warm-up's
    assert c["prompts"] == 2 and c["fresh_prompts"] is True and len(c["prompt_tokens"]) == 2
    drawn = [*c["prompt_tokens"], *c["warmup_prompt_tokens"]]
    assert len(drawn) == 3 and all(len(ts) == 2 and all(4 <= n <= 9 for n in ts) for ts in drawn)
    assert len(set(c["prompt_tokens"][0])) == 2  # prompts.seed 0 (the timed update) draws two lengths: two layouts
    assert c["warmup_prompt_tokens"][0] != c["prompt_tokens"][0]  # the timed update meets other layouts than the warm-up's
    assert report["errors"] == []
    for e in report["engines"].values():
        assert (e["pairs"], e["micro_batches"]) == (4, 2)  # 2 prompts × 2 samples × 1 window step
    assert report["engines"]["ours"]["first_update_ratio_exact_one"] is True
    assert "2 prompt(s) of" in (out / "train_bench.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--micro-batch", "0"], "--micro-batch must be >= 1 pair, got 0"),
    (["--steps", "3", "--window", "5"], "--window must be between 1 and --steps (3)"),
    (["--window", "0"], "--window must be between 1 and --steps (10)"),
    (["--group", "1"], "--group must be >= 2"),
    (["--prompts", "0"], "--prompts must be >= 1"),
    (["--ours-micro-batch", "0"], "--ours-micro-batch must be >= 1 pair, got 0"),
    (["--park-lookahead", "-1"], "--park-lookahead must be >= 0 keys, got -1"),
])
def test_bad_sizes_are_refused_before_any_work(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        train_bench.main(["--out", str(tmp_path / "out"), "--device", "cpu", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_passes_the_device_and_refuses_the_load_options(tmp_path: Path, monkeypatch, capsys) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(train_bench, "main", lambda argv: seen.append(list(argv)) or 0)
    assert cli_main(["bench", "train", "--out", str(tmp_path), "--device", "cpu"]) == 0
    assert cli_main(["bench", "train", "--out", str(tmp_path)]) == 0
    assert seen == [["--out", str(tmp_path), "--device", "cpu"], ["--out", str(tmp_path)]]
    assert cli_main(["bench", "train", "--out", str(tmp_path), "--repeats", "2"]) == 2
    assert "belong to `bench load`, not `bench train`" in capsys.readouterr().err


def test_bench_train_times_ours_with_parked_fold_nodes_beside_ours(tmp_path: Path) -> None:
    """``--engines ours ours_parked``: the same model twice in one process, the second with the fold's waiting nodes
    parked on the host (16 keys, micro-batches of 4: the level-3 node waits and is parked); both stay on-policy."""
    out = tmp_path / "out"
    assert train_bench.main(["--out", str(out), "--device", "cpu", "--steps", "3", "--group", "4", "--warmup", "0",
                             "--engines", "ours", "ours_parked"]) == 0
    report = json.loads((out / "train_bench.json").read_text())
    assert list(report["engines"]) == ["ours", "ours_parked"] and report["errors"] == []
    ours, parked = report["engines"]["ours"], report["engines"]["ours_parked"]
    assert ours["held_after_train"]["parked_peak_host_gib"] is None
    assert parked["held_after_train"]["parked_peak_host_gib"] > 0 and parked["held_after_train"]["parked_nodes"] > 0
    times = parked["held_after_train"]["park_host_s"]  # the park's host time, by call
    assert ours["held_after_train"]["park_host_s"] is None and 0 < times["host_alloc_s"] <= times["park_s"] and times["back_s"] > 0
    bufs = parked["held_after_train"]["park_buffers"]  # every park took a host buffer, made or handed back
    assert bufs["allocated"] > 0 and bufs["allocated"] + bufs["reused"] == parked["held_after_train"]["parked_nodes"]
    assert ours["first_update_ratio_exact_one"] is True and parked["first_update_ratio_exact_one"] is True
    assert report["ratios"] == {} and report["ratios_parked"] == {}  # no peer ran: no ratios
    assert "Ours / theirs" not in (out / "train_bench.md").read_text()


def test_runs_of_one_engine_each_merge_into_one_report(tmp_path: Path, capsys) -> None:
    """``--merge``: two runs (one engine each, as two GPU calls where both do not fit one) give the report a run of
    both would have, ratios from their figures; runs of another setup, machine or code, or sharing an engine, are
    refused with what differs."""
    common = ["--device", "cpu", "--steps", "2", "--window", "1", "--prompts", "2", "--fresh-prompts"]
    assert train_bench.main(["--out", str(tmp_path / "a"), *common, "--engines", "ours"]) == 0
    assert train_bench.main(["--out", str(tmp_path / "b"), *common, "--warmup", "0", "--engines", "diffusers_peft"]) == 0
    a, b = (tmp_path / "a" / "train_bench.json"), (tmp_path / "b" / "train_bench.json")
    assert train_bench.main(["--out", str(tmp_path / "m"), "--merge", str(a), str(b)]) == 0
    merged = json.loads((tmp_path / "m" / "train_bench.json").read_text())
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    assert list(merged["engines"]) == ["ours", "diffusers_peft"] and merged["errors"] == []
    assert merged["engines"]["ours"]["warmup"] == 1 and merged["engines"]["diffusers_peft"]["warmup"] == 0
    assert merged["config"]["warmup"] == "ours 1, diffusers_peft 0"
    # fresh prompts: the timed (and profiled) update draws the same prompts whatever the warm-up count
    assert ra["config"]["prompt_tokens"] == rb["config"]["prompt_tokens"] == merged["config"]["prompt_tokens"]
    assert len(ra["config"]["warmup_prompt_tokens"]) == 1 and rb["config"]["warmup_prompt_tokens"] == []
    for phase in [*train_bench.PHASES, "total"]:
        pick = (lambda r, n: r["engines"][n]["total"] if phase == "total" else r["engines"][n]["phases"][phase])
        assert merged["ratios"][phase]["wall_s"] == pytest.approx(pick(ra, "ours")["wall_s"] / pick(rb, "diffusers_peft")["wall_s"])
    assert [m["engines"] for m in merged["merged_from"]] == [["ours"], ["diffusers_peft"]]
    md = (tmp_path / "m" / "train_bench.md").read_text()
    assert merged["wall_s"] == pytest.approx(ra["wall_s"] + rb["wall_s"])  # the runs' processes, one after the other
    assert f"Wall time {merged['wall_s']:.0f} s." in md
    assert (tmp_path / "m" / "train_bench.png").is_file()
    assert "Merged from runs of one setup" in md and "Ours / theirs" in md and "| ours | total |" in md

    def refused(report: dict, message: str) -> None:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(report))
        with pytest.raises(SystemExit) as exc:
            train_bench.main(["--out", str(tmp_path / "x"), "--merge", str(a), str(bad)])
        assert exc.value.code == 2 and message in capsys.readouterr().err

    refused({**rb, "config": {**rb["config"], "steps": 3}}, "ran another setup than")
    refused({**rb, "environment": {**rb["environment"], "commit": "0000000"}}, "commit differ")
    refused(ra, "engine ours is in more than one report")
    # settings only ours reads: a run of the peer alone may have others (the merged config takes ours'), ours' may not
    peer_other = tmp_path / "peer_other.json"
    peer_other.write_text(json.dumps({**rb, "config": {**rb["config"], "keep_attention_outputs": False,
                                                       "park_lookahead": 0}}))
    assert train_bench.main(["--out", str(tmp_path / "m2"), "--merge", str(a), str(peer_other)]) == 0
    merged2 = json.loads((tmp_path / "m2" / "train_bench.json").read_text())
    assert merged2["config"]["keep_attention_outputs"] is True and merged2["config"]["park_lookahead"] is None
    ours_other = {**ra, "engines": {"ours_parked": ra["engines"]["ours"]},
                  "config": {**ra["config"], "keep_attention_outputs": False}}
    refused(ours_other, "keep_attention_outputs differ")
    refused({"engines": {}}, "is not a bench train report")
    assert not (tmp_path / "x").exists()


def test_ours_may_train_in_its_own_micro_batches_and_layout(tmp_path: Path) -> None:
    """``--ours-micro-batch 1 --ours-cfg-layout batched``: ours trains pair by pair with both CFG branches in one
    forward while the peer keeps micro-batches of 2 in the sequential layout; ours stays exactly on-policy."""
    out = tmp_path / "out"
    assert train_bench.main(["--out", str(out), "--device", "cpu", "--steps", "2", "--window", "1", "--warmup", "0",
                             "--ours-micro-batch", "1", "--ours-cfg-layout", "batched", "--no-keep-attention-outputs",
                             "--release-training-graphs", "--fold-batches", "--carry-fold-nodes"]) == 0
    report = json.loads((out / "train_bench.json").read_text())
    assert report["config"]["keep_attention_outputs"] is False and report["config"]["release_training_graphs"] is True
    assert report["config"]["carry_fold_nodes"] is True
    ours, theirs = report["engines"]["ours"], report["engines"]["diffusers_peft"]
    assert (ours["pairs"], ours["micro_batches"]) == (2, 2) and (theirs["pairs"], theirs["micro_batches"]) == (2, 1)
    assert ours["first_update_ratio_exact_one"] is True and report["ratios"]
    assert (report["config"]["ours_micro_batch"], report["config"]["ours_cfg_layout"]) == (1, "batched")
    md = (out / "train_bench.md").read_text()
    assert "Ours trains in micro-batches of 1 with CFG batched" in md and "Ours recomputes attention" in md


def test_the_peak_is_placed_at_the_first_mark_that_reaches_it() -> None:
    rows = [{"at": at, "micro_batch": i, "peak_so_far_gib": peak, "allocated_gib": 40.0, "captures": i}
            for i, (at, peak) in enumerate([("forward", 45.0), ("backward", 48.5), ("forward", 48.5), ("backward", 50.0),
                                            ("forward", 50.0)])]
    assert train_bench.peak_reached(rows) is rows[3]
    assert train_bench.peak_reached(rows[:3]) is rows[1]
    assert train_bench.peak_reached([]) is None


def test_a_process_builds_only_the_adapters_of_the_engines_it_runs(monkeypatch) -> None:
    """One engine per process (as at 1024²): only that side's model gets a LoRA, so its memory is one adapter's."""
    import torch

    from mmdit_strict.config.arch import preset

    attached = []
    real = train_bench.attach_lora
    monkeypatch.setattr(train_bench, "attach_lora",
                        lambda model, lora: attached.append(type(model).__name__) or real(model, lora))
    for names, want in ((("ours",), ["MMDiT"]), (("diffusers_peft",), ["QwenImageTransformer2DModel"]),
                        (("ours", "ours_parked"), ["MMDiT"]),
                        (("diffusers_peft", "ours"), ["MMDiT", "QwenImageTransformer2DModel"])):
        attached.clear()
        engines = train_bench.build_engines(preset("tiny"), "cpu", torch.float32, 4, names=names)
        assert [e.name for e in engines] == [n for n in ("diffusers_peft", "ours", "ours_parked") if n in names]
        assert attached == want, names
        for e in engines:
            assert any("lora_" in n and p.requires_grad for n, p in e.model.named_parameters()), e.name


def test_the_setup_sentence_names_how_ours_folds_parks_and_releases() -> None:
    """The report's setup says which sink options ours ran with (the epoch bars depend on them), nothing at defaults."""
    assert train_bench._sink_options({"fold_batches": False, "park_lookahead": None}) == ""
    said = train_bench._sink_options({"fold_batches": True, "carry_fold_nodes": True, "release_training_graphs": True,
                                      "park_lookahead": 0})
    assert said == (" Ours folds each captured forward's keys inside its backward, carries a left node into its "
                    "sibling's step, drops its training captures before each rollout and parks with a lookahead of 0 "
                    "keys (ours_parked).")
    assert train_bench._sink_options({"fold_batches": True}) == " Ours folds each captured forward's keys inside its backward."


def test_replot_draws_a_written_report_and_refuses_what_has_no_timings(tmp_path: Path) -> None:
    """``--replot``: the figure from a report's JSON alone (the committed H200 run's, with its memory panel); a report
    whose engines all failed, or no report, is refused naming the tool."""
    src = tmp_path / "train_bench.json"
    lean = Path(__file__).resolve().parents[2] / "experiments/training/78a71e0_epoch1024_h200_lean/train_bench.json"
    report = json.loads(lean.read_text())
    src.write_text(json.dumps(report))
    assert train_bench.main(["--replot", str(src)]) == 0
    assert src.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    failed = tmp_path / "failed.json"
    failed.write_text(json.dumps({**report, "engines": {"ours": {"error": "boom"}}}))
    with pytest.raises(SystemExit, match="bench.train --replot: .* holds no engine with phase timings"):
        train_bench.main(["--replot", str(failed)])
    with pytest.raises(SystemExit, match="no report at"):
        train_bench.main(["--replot", str(tmp_path / "missing.json")])
