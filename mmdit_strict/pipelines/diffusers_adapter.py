"""Our transformer inside diffusers' ``QwenImagePipeline``, the pipeline itself unchanged.

Two ways in::

    pipe = load_pipeline("path/to/Qwen-Image", runtime="strict", torch_dtype=torch.bfloat16, device="cuda")
    # or, on a pipeline you already have (weights shared, not copied):
    use_mmdit(pipe, runtime="strict")
    image = pipe("a cat", negative_prompt=" ", num_inference_steps=50).images[0]

What the pipeline needs of its transformer (``config.in_channels``, ``config.guidance_embeds``,
``dtype``, ``device``, ``cache_context``, the forward's keyword arguments, the LoRA methods that
``pipe.load_lora_weights`` calls) is provided by :class:`~mmdit_strict.model.MMDiT` itself
(``model/diffusers_compat.py``); this module only builds and assigns it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..config.arch import ArchConfig
from ..kernels.runtime import Runtime
from ..model import MMDiT


def mmdit_from_diffusers(transformer: torch.nn.Module, runtime: str | Runtime = "strict") -> MMDiT:
    """An ``MMDiT`` holding the very parameter tensors of diffusers' ``QwenImageTransformer2DModel``
    (no copy: both modules see later in-place changes). Same names, so the state dict maps one to one."""
    if isinstance(transformer, MMDiT):
        return transformer.set_runtime(runtime)
    config = getattr(transformer, "config", None)
    if config is None or not hasattr(transformer, "state_dict"):
        raise ValueError(f"expected diffusers' QwenImageTransformer2DModel, got {type(transformer).__name__}")
    arch = ArchConfig.from_diffusers_config(dict(config))
    with torch.device("meta"):
        model = MMDiT(arch, runtime=runtime)
    state = transformer.state_dict()
    if any("lora_" in k for k in state):
        raise ValueError("the diffusers transformer carries LoRA layers: load the LoRA on the MMDiT instead "
                         "(use_mmdit first, then pipe.load_lora_weights / model.load_lora_adapter)")
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def route_lora_methods(pipe: Any, model: MMDiT) -> None:
    """Point the pipeline's adapter methods (and ``save_pretrained``, :func:`route_save`) at ``model``.

    diffusers' pipeline-level ``set_adapters`` / ``disable_lora`` / ``enable_lora`` /
    ``delete_adapters`` only act on components that subclass its ``ModelMixin`` and silently skip
    others; Qwen-Image's only LoRA-loadable component is the transformer, so these instance
    attributes send the calls to it (``pipe.load_lora_weights`` already calls
    ``transformer.load_lora_adapter``). ``fuse_lora`` raises (the strict runtime never merges).
    """
    def set_adapters(adapter_names: Any, adapter_weights: Any = None) -> None:
        model.set_adapters(adapter_names, adapter_weights)

    pipe.set_adapters = set_adapters
    pipe.disable_lora = model.disable_lora
    pipe.enable_lora = model.enable_lora
    pipe.delete_adapters = model.delete_adapters
    pipe.fuse_lora = model.fuse_lora
    pipe.get_list_adapters = lambda: {"transformer": model.adapter_names()}
    pipe.get_active_adapters = lambda: model.active_adapters
    route_save(pipe)


def route_save(pipe: Any) -> None:
    """Make ``pipe.save_pretrained`` write the ``MMDiT`` transformer too.

    diffusers saves only components of its own model classes: it would log that the transformer
    "cannot be saved", record it as ``(None, None)`` in ``model_index.json`` and leave it out, so the
    folder would not load back. The wrapper lets diffusers save the rest, then writes the transformer
    in diffusers' format (``MMDiT.save_pretrained``) and records it as ``QwenImageTransformer2DModel``,
    so ``QwenImagePipeline.from_pretrained`` (or :func:`load_pipeline`) reads the folder back.
    """
    import json
    import logging

    original = pipe.save_pretrained
    entry = ["diffusers", "QwenImageTransformer2DModel"]

    def save_pretrained(save_directory: str | Path, *args: Any, **kwargs: Any) -> None:
        model = pipe.transformer
        if not isinstance(model, MMDiT):
            return original(save_directory, *args, **kwargs)
        log = logging.getLogger("diffusers.pipelines.pipeline_utils")
        level = log.level
        log.setLevel(logging.ERROR)  # the "cannot be saved" warning is answered below
        try:
            original(save_directory, *args, **kwargs)
        finally:
            log.setLevel(level)
            pipe.register_to_config(transformer=tuple(entry))
        model.save_pretrained(Path(save_directory) / "transformer")
        index = Path(save_directory) / "model_index.json"
        data = json.loads(index.read_text())
        data["transformer"] = entry
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

    pipe.save_pretrained = save_pretrained


def use_mmdit(pipe: Any, runtime: str | Runtime = "strict") -> MMDiT:
    """Replace ``pipe.transformer`` by an ``MMDiT`` over the same weights (and route the pipeline's
    adapter methods to it, :func:`route_lora_methods`); return it."""
    model = mmdit_from_diffusers(pipe.transformer, runtime)
    pipe.transformer = model
    route_lora_methods(pipe, model)
    return model


def load_pipeline(
    folder: str | Path,
    *,
    runtime: str | Runtime = "strict",
    torch_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Any:
    """``QwenImagePipeline.from_pretrained(folder)`` with our transformer loaded in its place (lazily,
    straight to ``device`` and ``torch_dtype``); the other components in ``torch_dtype`` too."""
    from diffusers import QwenImagePipeline

    from diffusers.pipelines import pipeline_utils

    transformer = MMDiT.from_pretrained(folder, runtime=runtime, torch_dtype=torch_dtype, device=device)
    # diffusers >= 0.37 names the argument dtype (torch_dtype still works, with a deprecation warning)
    dtype_kw = "dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"
    # transformer=None skips diffusers' own transformer (it type-checks components passed to from_pretrained)
    pipe = QwenImagePipeline.from_pretrained(str(folder), transformer=None, **{dtype_kw: torch_dtype})
    pipe.to(device)
    pipe.transformer = transformer
    route_lora_methods(pipe, transformer)
    return pipe
