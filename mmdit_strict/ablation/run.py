"""``ablate``: every entry of the plan as one ``run`` job, one status table, one report.

Layout of the output folder (claimed as an ``ablate`` folder; see ``trajectories.outdir``)::

    config.yaml        the composed ablate config
    ablation.yaml      one row per entry: pending | running | passed | failed | error, the job's exit
                       code (0 byte-identical, 1 drift, 2 error) and why it passed or failed; rewritten
                       as each job starts and ends
    <entry name>/      the entry's job: a ``run`` folder (config, rollout, recompute, report)
    ablation/          the report: report.md, report.json, plots

Every job's config is made from the ablate config and the entry's changes
(``config.compose.derive``) and checked, with its folder, before the first job runs. Jobs run in
this process one after the other. A job whose rollout settings equal an earlier job's starts from
that job's verified rollout (hard links, or a copy): ``run``'s stage key still decides whether it is
reused. With ``resume=true`` a rerun reuses every job's verified stages. An error in one job is
recorded in its row and the others still run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig
from tqdm.auto import tqdm

from ..config.compose import ConfigError, derive, save_resolved
from ..io import replace_dir
from ..trajectories import artifact, pipeline
from ..trajectories.jobs import JobTable
from ..overlay import check_perturbations
from ..trajectories.outdir import check_output_dir, claim_output_dir
from ..trajectories.setup import side_runtime
from ..trajectories.stagekey import ROLLOUT_READS, stage_settings
from .judge import error_row, judge
from .plan import Entry, plan
from .report import write_report

logger = logging.getLogger(__name__)

STATUS_FILE = "ablation.yaml"
REPORT_DIR = "ablation"


@dataclass
class AblationResult:
    """The rows of every entry (``judge``), and where the report is."""

    rows: list[dict[str, Any]]
    out_dir: Path
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == "failed"]

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == "error"]

    @property
    def passed(self) -> bool:
        return not self.failed and not self.errors

    @property
    def report_path(self) -> Path:
        return self.out_dir / REPORT_DIR / "report.md"


def job_configs(cfg: DictConfig, entries: list[Entry]) -> list[DictConfig]:
    """Each entry's ``run`` config (in ``OUTPUT_DIR/<name>``, no wandb), checked with its perturbation and its
    folder; a ConfigError naming the entry, before any job runs."""
    base = Path(cfg.output_dir)
    jobs = []
    for e in entries:
        try:
            job = derive(cfg, [*e.job_overrides(), f"output_dir={base / e.name}", "wandb.mode=disabled", "progress=false"])
            check_perturbations({side: (job[side].perturb, side_runtime(job, side).value) for side in ("rollout", "recompute")})
            check_output_dir(job.output_dir, kind="run")
        except (ConfigError, ValueError) as exc:
            raise ConfigError(f"ablation entry {e.name!r} ({' '.join(e.job_overrides()) or 'no changes'}): {exc}; "
                              "no entry was run") from exc
        jobs.append(job)
    return jobs


def _rollout_id(job: DictConfig) -> str:
    """The settings a job's rollout reads, as one string: equal strings, shareable rollouts."""
    return json.dumps(stage_settings(job, ROLLOUT_READS, "rollout"), sort_keys=True, default=str)


def _stage_key(folder: Path) -> Any:
    try:
        return json.loads((folder / artifact.MANIFEST).read_text()).get("stage_key")
    except (OSError, ValueError):
        return None


def _link_folder(src: Path, dst: Path) -> None:
    """Replace ``dst`` by a folder holding ``src``'s files (hard links where the file system allows), atomically.

    Artifacts are never written in place (``artifact.write`` builds a new folder and renames it), so a
    linked file is never changed through another folder.
    """
    tmp = dst.with_name(f".{dst.name}.linking")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.is_file():
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
    replace_dir(tmp, dst)


def share_rollout(job: DictConfig, donors: dict[str, Path]) -> bool:
    """Give ``job`` the rollout of an earlier job with the same rollout settings, unless it holds the same
    one already; True when it did. ``run`` checks the full stage key (weights, code, ...) before reusing it."""
    donor = donors.get(_rollout_id(job))
    own = Path(job.output_dir) / "rollout"
    if donor is None or donor == own:
        return False
    key = _stage_key(donor)
    if key is not None and _stage_key(own) == key:
        return False
    with claim_output_dir(job.output_dir, kind="run"):  # marks the job folder as a run folder, as run_all will
        _link_folder(donor, own)
    return True


def _release_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_entry(entry: Entry, job: DictConfig, donors: dict[str, Path], reward: str) -> dict[str, Any]:
    """Run one entry's job (sharing a rollout when one fits) and judge it."""
    if share_rollout(job, donors):
        logger.info("%s: starts from the rollout of %s", entry.name, donors[_rollout_id(job)].parent.name)
    try:
        result = pipeline.run_all(job, progress=False)
    finally:
        _release_memory()  # the job's models (graphs, prepacked weights) may sit in reference cycles
    out = Path(job.output_dir)
    donors.setdefault(_rollout_id(job), out / "rollout")
    rollout, recompute = artifact.read(out / "rollout"), artifact.read(out / "recompute")
    return judge(entry, result, rollout, recompute, reward)


def run_ablation(cfg: DictConfig, progress: bool = True,
                 on_row: Callable[[dict[str, Any]], None] | None = None) -> AblationResult:
    """Run every entry of ``cfg`` (an ``ablate`` config) and write the status table and the report.

    ``on_row`` sees each entry's row as soon as it is judged (the CLI prints one line).
    """
    entries = plan(cfg)
    jobs = job_configs(cfg, entries)
    reward = str(cfg.ablation.reward)
    with claim_output_dir(cfg.output_dir, kind="ablate") as out:
        save_resolved(cfg, out)
        table = JobTable(out / STATUS_FILE, [
            {"entry": e.name, "kind": e.kind, "expect": e.expect, "overrides": e.job_overrides(),
             "output_dir": str(job.output_dir)} for e, job in zip(entries, jobs)], key="entries")
        donors: dict[str, Path] = {}
        rows: list[dict[str, Any]] = []
        bar = tqdm(total=len(entries), desc="ablate", unit="entry", disable=not progress)
        for entry, job, status in zip(entries, jobs, table.rows):
            bar.set_postfix_str(entry.name)
            table.start(status)
            t0 = time.perf_counter()
            try:
                row = run_entry(entry, job, donors, reward)
                code = 0 if not row["first_drift"] else 1
            except Exception as exc:  # recorded in the entry's row; the other entries still run
                logger.debug("entry %s failed", entry.name, exc_info=True)
                row, code = error_row(entry, exc, str(job.output_dir)), 2
            except BaseException:
                table.end(status, "interrupted", 2)
                table.stop()
                raise
            row["seconds"] = round(time.perf_counter() - t0, 2)
            table.end(status, row["status"], code, passed=row["passed"], reason=row["reason"], seconds=row["seconds"])
            rows.append(row)
            bar.update(1)
            if on_row is not None:
                on_row(row)
        bar.close()
        report = write_report(out / REPORT_DIR, rows, cfg)
    return AblationResult(rows, out, report)
