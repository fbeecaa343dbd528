"""Which input images go with which prompt, read from a folder, and which edit contract a folder asks for.

An images folder has one of two layouts:

* **flat** — image files only: prompt ``i`` gets the ``i``-th file in order of name (one image per prompt,
  the Qwen-Image-Edit layout);
* **one subfolder per prompt** — subfolders only: prompt ``i`` gets every image file of the ``i``-th
  subfolder in order of name, e.g. ``images/00/a.png images/00/b.png images/01/a.png`` gives prompt 0 two
  images and prompt 1 one (Qwen-Image-Edit-Plus: its pictures are numbered 1, 2, ... in that order).

A folder that mixes files and subfolders, an empty subfolder or a missing folder is a clear error.
A pipeline folder whose ``model_index.json`` names ``QwenImageEditPlusPipeline`` is encoded with the Plus
contract (``encode_edit_plus``); any other edit folder with the one-image contract (``encode_edit``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
PLUS_PIPELINE = "QwenImageEditPlusPipeline"


def _image_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)


def image_set_files(folder: str | Path) -> list[list[Path]]:
    """The image files of each prompt in ``folder`` (either layout of the module docstring)."""
    p = Path(folder)
    if not p.is_dir():
        raise ValueError(f"images folder {folder} is not a folder")
    files = _image_files(p)
    subs = sorted(d for d in p.iterdir() if d.is_dir() and not d.name.startswith("."))
    if files and subs:
        raise ValueError(f"images folder {folder} mixes image files and subfolders: use either one image file per prompt "
                         "or one subfolder per prompt (holding that prompt's images)")
    if files:
        return [[f] for f in files]
    if not subs:
        raise ValueError(f"images folder {folder} holds no image ({', '.join(IMAGE_SUFFIXES)}) and no subfolder")
    sets = [_image_files(d) for d in subs]
    empty = [d.name for d, s in zip(subs, sets) if not s]
    if empty:
        raise ValueError(f"images folder {folder}: subfolder {empty[0]} holds no image ({', '.join(IMAGE_SUFFIXES)})")
    return sets


def set_names(folder: str | Path, sets: list[list[Path]]) -> list[list[str]]:
    """Each file's name relative to ``folder`` (``a.png`` or ``00/a.png``)."""
    return [[f.relative_to(Path(folder)).as_posix() for f in s] for s in sets]


def load_image_sets(folder: str | Path) -> list[tuple[list[str], list[Any]]]:
    """``(names, RGB PIL images)`` per prompt, in order (module docstring)."""
    from PIL import Image

    sets = image_set_files(folder)
    out = []
    for names, files in zip(set_names(folder, sets), sets):
        images = []
        for f in files:
            with Image.open(f) as im:
                images.append(im.convert("RGB"))
        out.append((names, images))
    return out


def is_plus_folder(pipeline_folder: str | Path) -> bool:
    """Whether the pipeline folder's ``model_index.json`` names the Qwen-Image-Edit-Plus pipeline."""
    index = Path(pipeline_folder) / "model_index.json"
    return index.is_file() and json.loads(index.read_text()).get("_class_name") == PLUS_PIPELINE
