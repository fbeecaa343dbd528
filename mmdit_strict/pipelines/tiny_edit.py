"""A tiny random Qwen-Image-Edit pipeline folder, made offline: the tiny Qwen-Image folder plus what an
image-conditioned prompt needs.

It is :func:`~mmdit_strict.pipelines.tiny.save_tiny_pipeline`'s folder (the same text encoder, transformer
and VAE bytes for the same seed) with three changes, laid out as the released Qwen-Image-Edit folder::

    folder/
      model_index.json      _class_name QwenImageEditPipeline (QwenImageEditPlusPipeline with ``plus``),
                            a ``processor`` entry (Qwen2VLProcessor)
      tokenizer/            the tiny tokenizer plus <|image_pad|> <|video_pad|> <|vision_start|> <|vision_end|>
      processor/            the same tokenizer + preprocessor_config.json (Qwen2VLImageProcessor) and
                            video_preprocessor_config.json (Qwen2VLVideoProcessor)

The four vision tokens are appended after the existing ones, in the order of the text encoder's config
(``image_token_id`` = the old vocabulary size, then video, vision start, vision end): the ids of every
existing token and the embedding table do not change. The image processor's patch (14), temporal patch (2)
and merge (2) sizes are the tiny vision tower's; its pixel budget is small (:data:`MAX_PIXELS`) so an input
image becomes at most 64 patches (16 image tokens) on the CPU.

transformers 5 constructs ``Qwen2VLProcessor`` only with torchvision installed (its video processor
needs it); :func:`load_processor` builds one from ``processor/`` without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .tiny import save_tiny_pipeline

VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16


def add_vision_tokens(tokenizer: Any) -> Any:
    """Append :data:`VISION_TOKENS` (special) to ``tokenizer`` in place; existing ids are unchanged."""
    base = len(tokenizer)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    if ids != list(range(base, base + len(VISION_TOKENS))):
        raise RuntimeError(f"vision tokens got ids {ids}, expected {base}..{base + len(VISION_TOKENS) - 1}")
    return tokenizer


def tiny_image_processor() -> Any:
    """A Qwen2-VL image processor with the tiny vision tower's patch sizes and a small pixel budget."""
    from transformers import AutoImageProcessor  # noqa: F401  (registers the auto classes)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE,
                                    size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


def _video_config() -> dict[str, Any]:
    """The video processor's settings (written as JSON: building the object needs torchvision)."""
    return {"video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2VLProcessor",
            "patch_size": PATCH_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE, "merge_size": MERGE_SIZE,
            "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}


def save_tiny_edit_pipeline(folder: str | Path, seed: int = 0, plus: bool = False) -> Path:
    """Write the tiny Qwen-Image-Edit pipeline folder (layout in the module docstring); ``plus``: the same
    folder named a ``QwenImageEditPlusPipeline`` (several input images per prompt; same components)."""
    from transformers import AutoTokenizer

    folder = save_tiny_pipeline(folder, seed)
    tokenizer = add_vision_tokens(AutoTokenizer.from_pretrained(str(folder / "tokenizer")))
    tokenizer.save_pretrained(str(folder / "tokenizer"))
    tokenizer.save_pretrained(str(folder / "processor"))
    tiny_image_processor().save_pretrained(str(folder / "processor"))
    (folder / "processor" / "video_preprocessor_config.json").write_text(json.dumps(_video_config(), indent=2, sort_keys=True) + "\n")
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index["_class_name"] = "QwenImageEditPlusPipeline" if plus else "QwenImageEditPipeline"
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return folder


def load_processor(folder: str | Path) -> Any:
    """``Qwen2VLProcessor`` of a pipeline folder's ``processor/``; without torchvision (which transformers 5's
    video processor needs) one with the image processor and tokenizer only, for image prompts."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin
    from transformers.utils import is_torchvision_available

    path = Path(folder) / "processor"
    if not path.is_dir():
        raise FileNotFoundError(f"{folder} has no processor/ folder: pass a Qwen-Image-Edit pipeline folder")
    if is_torchvision_available():
        return Qwen2VLProcessor.from_pretrained(str(path))
    proc = Qwen2VLProcessor.__new__(Qwen2VLProcessor)  # __init__'s class check asks for a torchvision-only class
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    proc.image_processor, proc.tokenizer, proc.video_processor, proc.chat_template = (
        AutoImageProcessor.from_pretrained(str(path)), tokenizer, None, None)
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id, proc.video_token_id = tokenizer.convert_tokens_to_ids([proc.image_token, proc.video_token])
    assert isinstance(proc, ProcessorMixin)
    return proc
