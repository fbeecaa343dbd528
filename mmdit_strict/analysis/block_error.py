"""Per-block error curve: strict vs production vs the FP64 reference, stage by stage.

    python -m mmdit_strict.analysis.block_error --out DIR [--checkpoint PATH] [--batch 2] [--grid 8 8]

For one model and one set of inputs, the activations after every stage — timestep embedding,
``img_in``, ``txt_in``, each block's image and text streams, ``norm_out`` and the velocity — are
captured from three forwards on the same weights:

* ``strict``: the strict runtime (registry operators on packed rows);
* ``production``: runtime ``off`` (the production operators on padded tensors);
* ``reference``: :func:`mmdit_strict.reference.model.reference_forward` in FP64.

All captures are packed valid rows (sample-major, text padding dropped), so they line up row by row.
For each stage and pair the curve records max abs error, max abs error relative to the stage's
largest |reference| value, RMS error relative to the RMS of the reference, and (strict vs
production) whether the bytes are equal. Writes ``block_error.json`` and, with matplotlib,
``block_error.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from ..figures import pyplot, save_png
from ..model.inputs import random_inputs

from ..kernels.runtime import Runtime, runtime_mode
from ..model.mmdit import MMDiT, ModelInputs

logger = logging.getLogger(__name__)

PAIRS = (("strict", "reference"), ("production", "reference"), ("strict", "production"))


def _packed_text(t: torch.Tensor, lens: Sequence[int]) -> torch.Tensor:
    return torch.cat([t[b, :n] for b, n in enumerate(lens)], dim=0)


def _production_stages(model: MMDiT, inputs: ModelInputs) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from ..model.strict import capture_operators

    store: dict[str, torch.Tensor] = {}
    with torch.no_grad(), capture_operators() as ops:  # padded (B, T, D) captures of the production operators
        out = model.production_forward(inputs, capture=store)
    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, t.shape[-1])

    store["temb"] = ops["embed.timestep_embed_mlp"]
    store["img_in"] = rows(ops["img_in.latent_proj_gemm"])
    store["txt_in"] = _packed_text(ops["txt_in.txt_in_rmsnorm_linear"], inputs.txt_lens)
    store["norm_out"] = rows(ops["norm_out.final_adaln_out"])
    return store, out.detach()


def _strict_stages(model: MMDiT, inputs: ModelInputs) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from ..model.strict import capture_operators, strict_forward

    store: dict[str, torch.Tensor] = {}
    with torch.no_grad(), runtime_mode(Runtime.STRICT), capture_operators() as ops:
        out = strict_forward(model, inputs, block_capture=store)
    store["temb"] = ops["embed.timestep_embed_mlp"]
    store["img_in"] = ops["img_in.latent_proj_gemm"]
    store["txt_in"] = ops["txt_in.txt_in_rmsnorm_linear"]
    store["norm_out"] = ops["norm_out.final_adaln_out"]
    return store, out.detach()


def _reference_stages(model: MMDiT, inputs: ModelInputs) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from ..reference.model import reference_forward

    store: dict[str, torch.Tensor] = {}
    out = reference_forward(
        model.state_dict(), model.config, inputs.hidden_states, inputs.encoder_hidden_states, inputs.txt_mask,
        inputs.sigma, inputs.img_shapes, capture=store,
    )
    return store, out


def _metrics(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, Any]:
    a, e = actual.detach().to("cpu", torch.float64), expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise ValueError(f"captures do not line up: {tuple(a.shape)} vs {tuple(e.shape)}")
    err = (a - e).abs()
    max_ref = float(e.abs().max()) if e.numel() else 0.0
    rms_ref = float(e.pow(2).mean().sqrt()) if e.numel() else 0.0
    max_abs = float(err.max()) if err.numel() else 0.0
    return {
        "max_abs": max_abs,
        "max_rel": max_abs / max_ref if max_ref else 0.0,
        "rms_rel": float(err.pow(2).mean().sqrt()) / rms_ref if rms_ref else 0.0,
        "max_abs_ref": max_ref,
    }


def block_error_curve(model: MMDiT, inputs: dict[str, Any], *, reference: bool = True) -> dict[str, Any]:
    """Per-stage errors of strict and production against each other and the FP64 reference.

    Args:
        model: an :class:`MMDiT` on the CPU in FP32 (the strict CPU backend's dtype); its runtime
            setting is left untouched.
        inputs: forward arguments by diffusers' names (``hidden_states``, ``encoder_hidden_states``,
            ``encoder_hidden_states_mask``, ``timestep``, ``img_shapes``).
        reference: also run the FP64 reference (slow at large sizes).

    Returns:
        ``{"stages": [...], "pairs": {"strict_vs_reference": [{stage, max_abs, max_rel, rms_rel, ...}], ...},
        "inputs": {...}}`` — one entry per stage in forward order; ``strict_vs_production`` entries
        also carry ``byte_equal``.
    """
    validated = model.validate_inputs(
        inputs["hidden_states"], inputs["encoder_hidden_states"], inputs.get("encoder_hidden_states_mask"),
        inputs["timestep"], inputs["img_shapes"],
    )
    runs = {"strict": _strict_stages(model, validated), "production": _production_stages(model, validated)}
    if reference:
        runs["reference"] = _reference_stages(model, validated)
    order = ["temb", "img_in", "txt_in"]
    for i in range(model.config.num_layers):
        order += [f"block{i}.img", f"block{i}.txt"]
    order += ["norm_out", "output"]
    caps = {name: dict(stages, output=out.reshape(-1, out.shape[-1])) for name, (stages, out) in runs.items()}
    pairs: dict[str, list[dict[str, Any]]] = {}
    for a, b in PAIRS:
        if a not in caps or b not in caps:
            continue
        rows = []
        for stage in order:
            entry = {"stage": stage, **_metrics(caps[a][stage], caps[b][stage])}
            if b != "reference":
                entry["byte_equal"] = bool(torch.equal(caps[a][stage], caps[b][stage]))
            rows.append(entry)
        pairs[f"{a}_vs_{b}"] = rows
    return {
        "stages": order,
        "pairs": pairs,
        "inputs": {
            "batch": int(validated.hidden_states.shape[0]),
            "image_tokens": int(validated.hidden_states.shape[1]),
            "text_lengths": list(validated.txt_lens),
            "img_shapes": [[list(s) for s in per] for per in validated.img_shapes],
            "sigma": [float(s) for s in validated.sigma.tolist()],
            "dtype": str(model.dtype).replace("torch.", ""),
        },
        "arch": model.config.to_dict(),
    }


def write_block_error(result: dict[str, Any], out_dir: str | Path, name: str = "block_error", png: bool = True) -> dict[str, Path]:
    """Write ``<name>.json`` (and ``<name>.png`` when matplotlib is importable) atomically into ``out_dir``."""
    from ..io import atomic_write_text

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": atomic_write_text(out_dir / f"{name}.json", json.dumps(result, indent=2) + "\n")}
    if png:
        try:
            plt = pyplot()
        except ImportError:
            logger.info("matplotlib not installed: no %s.png", name)
            return paths
        stages = result["stages"]
        fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(stages)), 4.0))
        nonzero = [r["max_rel"] for rows in result["pairs"].values() for r in rows if r["max_rel"] > 0]
        floor = min(nonzero) / 10 if nonzero else 1e-12  # where exact (byte-equal) agreement is drawn
        for pair, rows in result["pairs"].items():
            line, = ax.semilogy(range(len(rows)), [max(r["max_rel"], floor) for r in rows], marker="o",
                                label=pair.replace("_", " "))
            exact = [i for i, r in enumerate(rows) if r["max_rel"] == 0]
            if exact:
                ax.scatter(exact, [floor] * len(exact), marker="v", s=80, color=line.get_color(), zorder=3,
                           label=f"{pair.replace('_', ' ')}: identical")
        ax.set_xticks(range(len(stages)))
        ax.set_xticklabels(stages, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("max |error| / max |reference|")
        ax.set_title(f"per-stage error, {result['arch'].get('num_layers')} blocks, B={result['inputs']['batch']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        paths["png"] = save_png(fig, out_dir / f"{name}.png", dpi=120)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--name", default="block_error", help="file stem of the JSON/PNG")
    parser.add_argument("--checkpoint", default=None, help="diffusers transformer folder or hub id (default: the tiny preset, seeded init)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--grid", type=int, nargs=2, default=(8, 8), metavar=("H", "W"))
    parser.add_argument("--txt-lens", type=int, nargs="+", default=None)
    parser.add_argument("--no-reference", action="store_true")
    args = parser.parse_args(argv)
    if args.checkpoint:
        model = MMDiT.from_pretrained(args.checkpoint)
    else:
        from ..config.arch import preset
        from ..model.init import build_model

        model = build_model(preset("tiny"), seed=args.seed)
    lens = args.txt_lens or [7 + 5 * b for b in range(args.batch)]
    if len(lens) != args.batch:
        parser.error(f"--txt-lens needs {args.batch} values")
    result = block_error_curve(model, random_inputs(model.config, tuple(args.grid), lens, pad_to=max(lens) + 3, seed=args.seed),
                               reference=not args.no_reference)
    paths = write_block_error(result, args.out, args.name)
    final = {k: v[-1]["max_rel"] for k, v in result["pairs"].items()}
    print(json.dumps({"written": {k: str(p) for k, p in paths.items()}, "output_max_rel": final}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
