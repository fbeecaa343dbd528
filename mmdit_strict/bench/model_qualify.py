"""Whole-model strict qualification: raw-byte invariance of the forward and the LoRA backward.

    python -m mmdit_strict.bench.model_qualify --out DIR [--preset qwen-image] [--layers 4] [--device cuda]
        [--dtype bfloat16] [--shapes 64x64 83x83 58x104] [--block-error-layers 2]

Per latent grid (``64x64``, ``83x83`` and ``58x104`` are 1024², 1328² and 1664×928), every check counts
outputs whose bytes are equal (``torch.equal``) out of those compared:

* ``batch``: each sample alone vs inside batches of 2, 3 and 8 at every position, beside prompts of
  other lengths;
* ``padding``: a prompt padded by 1, 7 and 64 tokens (prefix mask) vs unpadded;
* ``cfg``: cond and negative prompt in one batch vs one forward each;
* ``checkpointing``: a LoRA forward + backward with gradient checkpointing on vs off — the output and
  every LoRA gradient;
* ``repeats``: the same forward and the same backward three times;
* ``fallbacks``: operators the strict trace records as fallbacks (must be 0).

With ``--block-error-layers N`` the report adds the per-block error curve (strict vs production vs the
FP64 reference, :mod:`mmdit_strict.analysis.block_error`) of an N-block model on the first grid.
Writes ``DIR/model_qualify.{json,md}``. Exit status 0 when every count is full and nothing fell back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tqdm import tqdm

from ..dtypes import BY_CONFIG_NAME as DTYPES
from ..config.arch import ArchConfig, preset
from ..kernels.trace import capture_trace
from ..model.init import build_model
from ..model.inputs import random_inputs
from ..model.mmdit import MMDiT
from ..environment import commit, environment_line, gpu_environment

TEXT_LENS = (77, 5, 130, 33, 256, 1, 64, 100)  # valid prompt tokens of the 8 pool samples
PADS = (1, 7, 64)


def _grid(text: str) -> tuple[int, int]:
    h, _, w = text.partition("x")
    return int(h), int(w)


def _put(inp: dict[str, Any], device: str, dtype: torch.dtype) -> dict[str, Any]:
    return {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)) if isinstance(v, torch.Tensor) else v
            for k, v in inp.items()}


def _select(inp: dict[str, Any], rows: Sequence[int], pad_to: int | None = None) -> dict[str, Any]:
    """Samples ``rows`` of a pool batch, prompts cut to the longest valid one (or padded to ``pad_to``)."""
    mask = inp["encoder_hidden_states_mask"][list(rows)]
    ehs = inp["encoder_hidden_states"][list(rows)]
    longest = int(mask.sum(dim=1).max())
    width = pad_to if pad_to is not None else longest
    if width > ehs.shape[1]:
        extra = width - ehs.shape[1]
        ehs = torch.cat([ehs, ehs.new_full((ehs.shape[0], extra, ehs.shape[2]), 3.0)], dim=1)  # padding values never read
        mask = torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], dim=1)
    return {"hidden_states": inp["hidden_states"][list(rows)], "encoder_hidden_states": ehs[:, :width].contiguous(),
            "encoder_hidden_states_mask": mask[:, :width].contiguous(), "timestep": inp["timestep"][list(rows)],
            "img_shapes": [inp["img_shapes"][0]] * len(rows)}


class Counter:
    """Equal / compared counts per check, with the first few mismatches named."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.mismatches: list[str] = []

    def compare(self, check: str, a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
        """Count one comparison; two ``None`` (a gradient neither side produced) are not counted."""
        if a is None and b is None:
            return
        c = self.counts.setdefault(check, [0, 0])
        c[1] += 1
        if a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b):
            c[0] += 1
        elif len(self.mismatches) < 20:
            self.mismatches.append(f"{check}: {what}")


def _forward(model: MMDiT, inp: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inp).sample


def _lora_step(model: MMDiT, inp: dict[str, Any], up: torch.Tensor, checkpointing: bool) -> list[torch.Tensor | None]:
    """Output and every LoRA gradient of ``sum(out · up)`` (None for adapters the output does not reach,
    e.g. the last block's text stream)."""
    model.enable_gradient_checkpointing(checkpointing)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in params:
        p.grad = None
    out = model(**inp).sample
    (out.float() * up).sum().backward()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    model.enable_gradient_checkpointing(False)
    return [out.detach()] + grads


def qualify_grid(model: MMDiT, grid: tuple[int, int], device: str, dtype: torch.dtype, counter: Counter,
                 progress: Callable[[str], None]) -> None:
    arch = model.config
    lens = [min(n, 256) for n in TEXT_LENS]
    pool = _put(random_inputs(arch, grid, lens, seed=grid[0] * 1000 + grid[1]), device, dtype)
    alone = [_forward(model, _select(pool, [i])) for i in range(len(lens))]
    for B in (2, 3, 8):
        for shift in range(len(lens)):  # every sample at every position of a batch of B
            rows = [(shift + j) % len(lens) for j in range(B)]
            out = _forward(model, _select(pool, rows))
            for pos, i in enumerate(rows):
                counter.compare("batch", out[pos], alone[i][0], f"grid {grid} sample {i} at {pos}/{B}")
            if B == 8:
                break  # one batch of 8 holds every sample once
        progress(f"batch B={B}")
    for i in (0, 1):
        n = lens[i]
        for k in PADS:
            counter.compare("padding", _forward(model, _select(pool, [i], pad_to=n + k))[0], alone[i][0],
                            f"grid {grid} sample {i} +{k} pad")
    progress("padding")
    neg = 1  # sample 1's prompt as the negative prompt of sample 0
    both = dict(_select(pool, [0, neg]))
    both["hidden_states"] = torch.cat([pool["hidden_states"][:1]] * 2)
    both["timestep"] = torch.cat([pool["timestep"][:1]] * 2)
    batched = _forward(model, both)
    single_neg = _forward(model, {**_select(pool, [neg]), "hidden_states": pool["hidden_states"][:1],
                                  "timestep": pool["timestep"][:1]})
    counter.compare("cfg", batched[0], alone[0][0], f"grid {grid} cond")
    counter.compare("cfg", batched[1], single_neg[0], f"grid {grid} neg")
    progress("cfg")
    for _ in range(3):
        counter.compare("repeats", _forward(model, _select(pool, [0, 2])), _forward(model, _select(pool, [0, 2])),
                        f"grid {grid} forward")
    inp = _select(pool, [0, 3])
    up = torch.randn(inp["hidden_states"].shape, generator=torch.Generator().manual_seed(5)).to(device)
    on = _lora_step(model, inp, up, checkpointing=True)
    off = _lora_step(model, inp, up, checkpointing=False)
    for j, (a, b) in enumerate(zip(on, off)):
        counter.compare("checkpointing", a, b, f"grid {grid} {'output' if j == 0 else f'lora grad {j - 1}'}")
    again = _lora_step(model, inp, up, checkpointing=True)
    for j, (a, b) in enumerate(zip(on, again)):
        counter.compare("repeats", a, b, f"grid {grid} backward tensor {j}")
    progress("checkpointing + repeats")


def _attach_lora(model: MMDiT, rank: int) -> None:
    """A live LoRA (non-zero B) on Flow-GRPO's targets; everything else frozen."""
    from peft import LoraConfig, inject_adapter_in_model

    from .model import LORA_TARGETS

    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(LORA_TARGETS), lora_dropout=0.0), model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
            if "lora_" in name:
                p.copy_((0.01 * torch.randn(p.shape, generator=gen)).to(device=p.device, dtype=p.dtype))


def run(args: argparse.Namespace) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    arch: ArchConfig = preset(args.preset)
    if args.layers:
        arch = dataclasses.replace(arch, num_layers=args.layers)
    model = build_model(arch, seed=0, runtime="strict", dtype=dtype, device=args.device)
    _attach_lora(model, args.lora_rank)
    counter = Counter()
    grids = [_grid(s) for s in args.shapes]
    bar = tqdm(total=4 * len(grids), desc="model qualify", disable=args.quiet)
    with capture_trace() as trace:
        for grid in grids:
            qualify_grid(model, grid, args.device, dtype, counter, lambda what: (bar.set_postfix_str(what), bar.update(1)))
    bar.close()
    report: dict[str, Any] = {
        "preset": args.preset, "layers": arch.num_layers, "dtype": args.dtype, "device": args.device,
        "grids": [list(g) for g in grids], "checks": {k: {"equal": v[0], "compared": v[1]} for k, v in counter.counts.items()},
        "mismatches": counter.mismatches, "fallbacks": sorted({r.op for r in trace.fallbacks}),
        "operators": sorted({r.op for r in trace.records.values()}),
    }
    if args.block_error_layers:
        from ..analysis.block_error import block_error_curve

        small = build_model(dataclasses.replace(arch, num_layers=args.block_error_layers), seed=0, runtime="strict",
                            dtype=dtype, device=args.device)
        inp = _put(random_inputs(small.config, grids[0], [77, 20], seed=3), args.device, dtype)
        report["block_error"] = block_error_curve(small, inp, reference=True)
    return report


def render(report: dict[str, Any]) -> str:
    env = report.get("environment", {})
    lines = [f"# Strict whole-model qualification ({report['preset']}, {report['layers']} blocks, {report['dtype']}, {report['device']})", "",
             environment_line(env, "grids " + ", ".join(f"{h}×{w}" for h, w in report["grids"])), "",
             "| check | equal bytes | compared |", "|---|---|---|"]
    for name, c in report["checks"].items():
        lines.append(f"| {name} | {c['equal']} | {c['compared']} |")
    lines += ["", f"Fallbacks in the strict trace: {len(report['fallbacks'])} ({', '.join(report['fallbacks']) or 'none'}); "
              f"operators run: {len(report['operators'])}."]
    if report["mismatches"]:
        lines += ["", "First mismatches:", ""] + [f"- {m}" for m in report["mismatches"]]
    if "block_error" in report:
        lines += ["", "Per-block error: `block_error` in the JSON (strict / production / FP64 reference, stage by stage)."]
    return "\n".join(lines) + "\n"


def passed(report: dict[str, Any]) -> bool:
    return not report["fallbacks"] and all(c["equal"] == c["compared"] for c in report["checks"].values())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmdit_strict.bench.model_qualify", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="experiments/local", help="output folder")
    p.add_argument("--preset", default="qwen-image", choices=["qwen-image", "tiny"])
    p.add_argument("--layers", type=int, default=4, help="blocks (0 = the preset's)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--shapes", nargs="+", default=["64x64", "83x83", "58x104"], help="latent grids HxW in tokens")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--block-error-layers", type=int, default=0, help="also the per-block error curve of an N-block model")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    report = run(args)
    report["environment"] = gpu_environment() if torch.device(args.device).type == "cuda" else {"commit": commit(), "torch": torch.__version__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_qualify.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "model_qualify.md").write_text(render(report))
    print(render(report))
    return 0 if passed(report) else 1


if __name__ == "__main__":
    raise SystemExit(main())
