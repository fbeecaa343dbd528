"""The full chain around ``mmdit-strict run``: prompt text → embeddings → rollout / recompute / compare
→ decoded images, with each part's time in the report.

``mmdit-strict run model.checkpoint=<pipeline folder> prompts.text='[a cat, a dog]'`` runs:

1. **encode** (:func:`prepare_prompts`): when ``prompts.text`` is set, the folder's tokenizer and
   Qwen2.5-VL text encoder turn the prompts and ``prompts.negative`` into
   ``OUTPUT_DIR/prompts.safetensors`` (``encode.py``), and ``prompts.embeddings`` points there;
2. **rollout → recompute → compare → report**: the trajectories pipeline, unchanged;
3. **decode** (:func:`finish_images`): the rollout's final latents become ``OUTPUT_DIR/images/`` PNGs
   with the folder's VAE (the fixed preview without one), and the report gains a section with the
   contact sheet and the time of each part (text encoder, rollout and recompute — transformer plus
   scheduler steps —, VAE).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from ..dtypes import from_config

REPORT_BEGIN = "<!-- mmdit-strict:images -->"
REPORT_END = "<!-- /mmdit-strict:images -->"


def pipeline_folder(checkpoint: str | None) -> Path | None:
    """``checkpoint`` as a local diffusers pipeline folder (``model_index.json``), else None."""
    if not checkpoint:
        return None
    p = Path(str(checkpoint)).expanduser()
    return p if (p / "model_index.json").is_file() else None


@contextlib.contextmanager
def _claim(path: str | Path, kind: str = "run") -> Iterator[Path]:
    """The output-folder guard of the trajectories pipeline when present, else a plain mkdir."""
    try:
        from ..trajectories.outdir import claim_output_dir
    except ImportError:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        yield out
        return
    with claim_output_dir(path, kind=kind) as out:
        yield Path(out)


def prepare_prompts(cfg: DictConfig, kind: str = "run") -> tuple[DictConfig, dict[str, Any]]:
    """Encode ``prompts.text`` with the checkpoint folder's text encoder (step 1); return the config
    pointing ``prompts.embeddings`` at the file, and the timing record. A no-op without ``prompts.text``.
    The file goes into ``cfg.output_dir``, claimed as a folder of the command ``kind`` (run | train)."""
    texts = OmegaConf.select(cfg, "prompts.text")
    if not texts:
        return cfg, {}
    folder = pipeline_folder(cfg.model.checkpoint)
    if folder is None:
        raise ValueError("prompts.text needs model.checkpoint=<a Qwen-Image pipeline folder> (with tokenizer/ and "
                         "text_encoder/) to encode with; or encode first with `mmdit-strict encode` and pass prompts.embeddings")
    if cfg.prompts.embeddings:
        raise ValueError("set either prompts.text (encoded here) or prompts.embeddings (already encoded), not both")
    import torch

    from .encode import encode_prompts, load_text_components, write_prompt_file

    dtype = from_config(cfg.model.dtype)
    negative = OmegaConf.select(cfg, "prompts.negative", default=" ")
    with _claim(cfg.output_dir, kind) as out:
        t0 = time.perf_counter()
        tokenizer, encoder = load_text_components(folder, torch_dtype=dtype, device=cfg.model.device)
        t1 = time.perf_counter()
        if OmegaConf.select(cfg, "prompts.edit.source") == "folder" and (folder / "processor").is_dir():
            # each prompt with its input image; a folder without processor/ (a text-to-image folder, as the
            # sealed edit fixture's) keeps the text-only contract below
            path = _encode_edit_prompts(cfg, folder, [str(t) for t in texts], negative, encoder, out)
        else:
            encoded = encode_prompts(tokenizer, encoder, [str(t) for t in texts], negative, device=cfg.model.device)
            path = write_prompt_file(out / "prompts.safetensors", encoded, pipeline_folder=folder, batch_size=1)
        t2 = time.perf_counter()
        del encoder
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))  # a writable copy; the caller's stays read-only
    cfg.prompts.embeddings = str(path)
    OmegaConf.set_readonly(cfg, True)
    return cfg, {"text_encoder_load_seconds": t1 - t0, "text_encoder_seconds": t2 - t1, "prompts_file": str(path)}


def _encode_edit_prompts(cfg: DictConfig, folder: Path, texts: list[str], negative: str, encoder: Any, out: Path) -> Path:
    """``prompts.edit.source=folder`` with an edit folder (``processor/``): prompt ``i`` encoded with image set
    ``i mod n`` of ``prompts.edit.folder`` (``edit_images`` layouts: the set whose latents condition sample
    ``i``), its negative with the same images, into ``out/prompts.safetensors``. A Plus folder takes the Plus
    contract; any other edit folder one image per prompt."""
    from .edit_images import PLUS_PIPELINE, is_plus_folder, load_image_sets
    from .encode_edit import CONDITION_AREA, encode_edit_prompts, write_edit_prompt_file
    from .encode_edit_plus import PLUS_CONDITION_AREA, PLUS_PROMPT_TEMPLATE, encode_plus_prompts
    from .tiny_edit import load_processor

    if not cfg.prompts.edit.folder:
        raise ValueError("prompts.edit.source=folder needs prompts.edit.folder=DIR (the input pictures)")
    sets = load_image_sets(cfg.prompts.edit.folder)
    chosen = [sets[i % len(sets)] for i in range(len(texts))]
    processor = load_processor(folder)
    if is_plus_folder(folder):
        images: list[Any] = [ims for _, ims in chosen]
        encoded = encode_plus_prompts(processor, encoder, texts, images, negative, device=cfg.model.device)
        return write_edit_prompt_file(out / "prompts.safetensors", encoded, pipeline_folder=folder, batch_size=1,
                                      image_names=[n for n, _ in chosen], images=images, condition_area=PLUS_CONDITION_AREA,
                                      template=PLUS_PROMPT_TEMPLATE)
    if any(len(ims) > 1 for _, ims in chosen):
        raise ValueError(f"prompts.edit.folder={cfg.prompts.edit.folder} gives a prompt several images: that needs a "
                         f"Qwen-Image-Edit-Plus checkpoint folder (model_index.json _class_name {PLUS_PIPELINE})")
    images = [ims[0] for _, ims in chosen]
    encoded = encode_edit_prompts(processor, encoder, texts, images, negative, device=cfg.model.device)
    return write_edit_prompt_file(out / "prompts.safetensors", encoded, pipeline_folder=folder, batch_size=1,
                                  image_names=[n[0] for n, _ in chosen], images=images, condition_area=CONDITION_AREA)


def prepare_edit(cfg: DictConfig, kind: str = "run") -> DictConfig:
    """``prompts.edit.source=folder``: VAE-encode the input pictures into ``OUTPUT_DIR/conditioning.safetensors``
    (``edit_inputs.prepare_conditioning``) and return the config pointing at it. A no-op for other sources."""
    if OmegaConf.select(cfg, "prompts.edit.source") != "folder":
        return cfg
    from .edit_inputs import prepare_conditioning

    with _claim(cfg.output_dir, kind) as out:
        return prepare_conditioning(cfg, out)


def finish_images(cfg: DictConfig, timings: dict[str, Any]) -> dict[str, Any]:
    """Decode the rollout's final latents (step 3) and add the images section to the report."""
    from ..trajectories.artifact import read
    from .vae import decode_rollout

    with _claim(cfg.output_dir) as out:
        info = decode_rollout(out / "rollout", out / "images", pipeline_folder(cfg.model.checkpoint), device=cfg.model.device)
        rollout_s = float(read(out / "rollout", verify=False).manifest.get("wall_seconds", float("nan")))
        recompute_s = float(read(out / "recompute", verify=False).manifest.get("wall_seconds", float("nan"))) \
            if (out / "recompute").is_dir() else float("nan")
        times = {**timings, "rollout_seconds": rollout_s, "recompute_seconds": recompute_s,
                 "vae_seconds" if info["mode"] == "vae" else "preview_seconds": info["decode_seconds"]}
        (out / "images" / "timings.json").write_text(json.dumps(times, indent=2))
        restore_images_section(out)
    return {**info, "timings": times}


def restore_images_section(run_dir: str | Path) -> bool:
    """(Re)write the report's images section from ``images/decode.json`` and ``images/timings.json``
    (after ``mmdit-strict report`` rebuilt the report). False when the run has no decoded images."""
    run_dir = Path(run_dir)
    info_path, times_path = run_dir / "images" / "decode.json", run_dir / "images" / "timings.json"
    report = run_dir / "report" / "report.md"
    if not (info_path.is_file() and times_path.is_file() and report.is_file()):
        return False
    info, times = json.loads(info_path.read_text()), json.loads(times_path.read_text())
    shutil.copyfile(run_dir / "images" / "contact_sheet.png", report.parent / "contact_sheet.png")
    _write_section(report, _section(info, times))
    return True


def _section(info: dict[str, Any], times: dict[str, Any]) -> str:
    what = ("decoded with the pipeline's VAE (latents denormalized with its latents_mean / latents_std)"
            if info["mode"] == "vae" else "fixed latent→RGB preview (no VAE in the checkpoint folder; layout, not colours)")
    rows = [("text encoder (load)", times.get("text_encoder_load_seconds")), ("text encoder (encode)", times.get("text_encoder_seconds")),
            ("rollout: transformer + scheduler steps", times.get("rollout_seconds")),
            ("recompute: transformer + scheduler steps (+ backward)", times.get("recompute_seconds")),
            ("VAE decode" if info["mode"] == "vae" else "preview", info["decode_seconds"])]
    lines = [REPORT_BEGIN, "", "## Images", "", f"Final rollout latents, {what}: `images/`.", "",
             "![contact sheet](contact_sheet.png)", "", "| part | seconds |", "|---|---|"]
    lines += [f"| {name} | {sec:.3f} |" for name, sec in rows if sec is not None]
    return "\n".join(lines + ["", REPORT_END, ""])


def _write_section(report: Path, section: str) -> None:
    """Put ``section`` at the end of the report, replacing an earlier one (re-runs do not stack)."""
    text = report.read_text()
    if REPORT_BEGIN in text and REPORT_END in text:
        head, rest = text.split(REPORT_BEGIN, 1)
        text = head + rest.split(REPORT_END, 1)[1].lstrip("\n")
    report.write_text(text.rstrip("\n") + "\n\n" + section)
