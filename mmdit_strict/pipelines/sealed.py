"""Sealed fixtures: a whole text → image run frozen in files, replayed later to prove nothing moved.

A fixture folder holds everything the run reads and what it produced::

    pipeline/          the tiny random pipeline (tokenizer, text encoder, transformer, VAE, scheduler)
    expected.safetensors   the rollout's final latents ``x`` and its ``logp`` (FP32)
    sample_*.png       the decoded images
    fixture.json       the run's overrides, the rollout's per-step hashes of v, x and logp, the sha256
                       of every other file, and the platform it was sealed on

CPU bytes are promised per platform only (machine, CPU vector capability, torch version): on the
sealing platform a replay must match every per-step hash and the final latents byte for byte; on
another one it is compared within ``tolerances.yaml: pipelines.sealed_latents_other_platform`` and
says so. Latent equality is the gate; the images' PSNR against the sealed ones is reported beside it.

A GPU fixture (sealed with ``device="cuda"``: the model in BF16 on the GPU, the strict Triton kernels)
records the GPU platform (device name, compute capability, torch, Triton and CUDA versions). Its bytes are
promised on that platform only; no tolerance is declared for another GPU, so a replay elsewhere does not
pass and says why.
"""

from __future__ import annotations

import json
import platform as host
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..trajectories.hashing import file_sha256

FIXTURE = "fixture.json"
EXPECTED = "expected.safetensors"


GPU_OVERRIDES = ("model.device=cuda", "model.dtype=bfloat16")


def platform_id(device: str = "cpu") -> dict[str, str]:
    """What the bytes depend on here. CPU: the machine, torch's CPU vector capability and the torch version;
    CUDA: the GPU's name and compute capability, and the torch, Triton and CUDA versions."""
    if device == "cpu":
        return {"machine": host.machine(), "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
                "torch": torch.__version__}
    if device != "cuda":
        raise ValueError(f"sealed fixtures run on 'cpu' or 'cuda', got {device!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("this sealed fixture runs on a CUDA GPU, and none is available here")
    import triton

    major, minor = torch.cuda.get_device_capability()
    return {"gpu": torch.cuda.get_device_name(), "capability": f"sm_{major}{minor}", "torch": torch.__version__,
            "triton": triton.__version__, "cuda": str(torch.version.cuda)}


def fixture_device(record: dict[str, Any]) -> str:
    """``"cuda"`` for a fixture sealed on a GPU, else ``"cpu"``."""
    return "cuda" if GPU_OVERRIDES[0] in record["overrides"] else "cpu"


def _run(pipeline: Path, overrides: Sequence[str], out: Path) -> None:
    """``mmdit-strict run`` on the fixture's pipeline: encode the prompts, rollout → recompute → compare, decode."""
    from ..config.compose import compose
    from ..trajectories.pipeline import run_all
    from .chain import finish_images, prepare_edit, prepare_prompts

    fixture = pipeline.parent  # overrides name the fixture's own files as {fixture}/... (edit: its input pictures)
    overrides = [o.replace("{fixture}", str(fixture)) for o in overrides]
    cfg = compose(["rollout.save_tensors=true", *overrides, f"model.checkpoint={pipeline}", f"output_dir={out}",
                   "wandb.mode=disabled", "progress=false"])
    cfg, timings = prepare_prompts(cfg)
    cfg = prepare_edit(cfg)
    result = run_all(cfg, progress=False)
    finish_images(cfg, timings)
    if not result.byte_identical:
        raise RuntimeError(f"the sealed run's two sides are not byte-identical ({result.summary}); see {out}")


def _step_hashes(run_dir: Path) -> list[dict[str, list[str]]]:
    manifest = json.loads((run_dir / "rollout" / "manifest.json").read_text())
    return [{q: s[q] for q in ("v", "x", "logp")} for s in manifest["steps"]]


def seal(folder: str | Path, overrides: Sequence[str], seed: int = 0,
         pictures: dict[str, np.ndarray] | None = None, device: str = "cpu") -> dict[str, Any]:
    """Make the tiny pipeline in ``folder/pipeline``, run ``run`` with ``overrides`` on it, and freeze the result.

    ``pictures`` (edit fixtures): ``name → (H, W, 3) uint8`` written as PNGs to ``folder/input/``, which the
    overrides name as ``{fixture}/input``; they are sealed with every other file. ``device="cuda"`` seals a GPU
    fixture (:data:`GPU_OVERRIDES` join the overrides)."""
    plat = platform_id(device)  # fails before any work where the device is missing
    overrides = [*overrides, *(GPU_OVERRIDES if device == "cuda" else ())]
    from safetensors.torch import save_file

    from ..trajectories.artifact import read
    from .tiny import save_tiny_pipeline

    folder = Path(folder)
    if folder.exists():
        shutil.rmtree(folder)
    pipe = save_tiny_pipeline(folder / "pipeline", seed=seed)
    if pictures:
        from PIL import Image

        (folder / "input").mkdir()
        for name, arr in sorted(pictures.items()):
            Image.fromarray(arr).save(folder / "input" / name)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        _run(pipe, overrides, run)
        traj = read(run / "rollout")
        save_file({"x": traj.tensors["x"][-1].contiguous(), "logp": traj.tensors["logp"].contiguous()}, str(folder / EXPECTED))
        for png in sorted((run / "images").glob("sample_*.png")):
            shutil.copy(png, folder / png.name)
        steps = _step_hashes(run)
        conditioning = traj.manifest.get("conditioning")  # edit: the input pictures' latents as the run read them
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != FIXTURE)
    record = {"overrides": list(overrides), "seed": seed, "platform": plat, "steps": steps,
              **({"conditioning": conditioning} if conditioning else {}),
              "files": {str(p.relative_to(folder)): file_sha256(str(p)) for p in files}}
    (folder / FIXTURE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


@dataclass
class Replay:
    """What a replay of a sealed fixture found."""

    same_platform: bool
    steps_equal: bool  # every per-step hash of v, x and logp
    latents_equal: bool  # the final latents, byte for byte
    latents_within_tolerance: bool
    latents_max_abs: float
    psnr_db: list[float] = field(default_factory=list)  # per image against the sealed one (inf: identical)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Byte equality on the sealing platform; the declared tolerance elsewhere."""
        return (self.steps_equal and self.latents_equal) if self.same_platform else self.latents_within_tolerance


def verify_files(folder: str | Path) -> dict[str, Any]:
    """The fixture's record, after checking every file against its sealed sha256 (ValueError naming the first bad one)."""
    folder = Path(folder)
    record = json.loads((folder / FIXTURE).read_text())
    for rel, digest in sorted(record["files"].items()):
        path = folder / rel
        if not path.is_file():
            raise ValueError(f"sealed fixture {folder}: {rel} is missing")
        if file_sha256(str(path)) != digest:
            raise ValueError(f"sealed fixture {folder}: {rel} does not match its sealed sha256 (changed or damaged)")
    return record


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * float(np.log10(255.0**2 / mse))


def replay(folder: str | Path, work: str | Path) -> Replay:
    """Run the sealed fixture again in ``work`` and compare it with what was sealed."""
    from PIL import Image
    from safetensors.torch import load_file

    from ..tolerances import tolerance
    from ..trajectories.artifact import read

    folder, work = Path(folder), Path(work)
    record = verify_files(folder)
    device = fixture_device(record)
    here = platform_id(device)
    _run(folder / "pipeline", record["overrides"], work)
    same = record["platform"] == here
    steps_equal = _step_hashes(work) == record["steps"]
    if "conditioning" in record:  # edit: the VAE-encoded input latents are part of the per-step bytes
        steps_equal = steps_equal and read(work / "rollout", verify=False).manifest.get("conditioning") == record["conditioning"]
    expected = load_file(str(folder / EXPECTED))["x"]
    got = read(work / "rollout").tensors["x"][-1]
    equal = got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(
        got.contiguous().view(torch.int32), expected.contiguous().view(torch.int32))
    if device == "cpu":
        tol = tolerance("pipelines", "sealed_latents_other_platform", torch.float32)
        within, max_abs, _ = tol.check(got, expected)
    else:  # no tolerance is declared across GPU platforms: only the sealing platform's bytes count
        within, max_abs = False, float((got.double() - expected.double()).abs().max())
    out = Replay(same, steps_equal, equal, within, max_abs)
    for png in sorted(folder.glob("sample_*.png")):
        mine = work / "images" / png.name
        if mine.exists():
            out.psnr_db.append(_psnr(np.asarray(Image.open(mine)), np.asarray(Image.open(png))))
    if not same and device == "cpu":
        out.notes.append(f"sealed on {record['platform']}, replayed on {here}: CPU bytes are promised per "
                         f"platform, so the latents were compared within the declared tolerance (max |Δ| {max_abs:.3e})")
    elif not same:
        out.notes.append(f"sealed on {record['platform']}, replayed on {here}: GPU bytes are promised on the sealing "
                         f"platform only and no tolerance is declared for another one (max |Δ| {max_abs:.3e})")
    return out
