"""What diffusers code expects of a transformer, on :class:`~mmdit_strict.model.MMDiT`.

``QwenImagePipeline`` (and the habits of diffusers users) touch a model through a small surface:
``config.in_channels`` / ``config.guidance_embeds``, ``dtype`` / ``device``, the ``cache_context``
context manager around each forward, ``attention_kwargs``, gradient-checkpointing switches, and the
LoRA methods of diffusers' ``PeftAdapterMixin`` (``load_lora_adapter``, ``set_adapters``,
``disable_lora`` …). :class:`DiffusersCompatMixin` provides that surface on top of PEFT, with no
import of diffusers, so an ``MMDiT`` in any runtime mode can be assigned to
``QwenImagePipeline.transformer`` and the pipeline runs unchanged.

What is refused, with a ValueError that says what to do instead:

* ``attention_kwargs`` other than ``None`` / ``{}`` / ``{"scale": 1.0}`` (LoRA scales are set with
  ``set_adapters(..., weights=...)``; there are no attention processors to pass arguments to);
* ``fuse_lora`` (the strict runtime never merges an adapter into base weights), and ``hotswap``.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch

if TYPE_CHECKING:
    from peft import LoraConfig

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' file name for a saved adapter
LORA_METADATA_KEY = "lora_adapter_metadata"  # diffusers' safetensors metadata key holding the LoraConfig
PEFT_WEIGHT_NAME = "adapter_model.safetensors"  # PEFT's file name for a saved adapter
PEFT_CONFIG_NAME = "adapter_config.json"  # PEFT's LoraConfig, beside its weights
PEFT_KEY_PREFIX = "base_model.model"  # PeftModel's wrapper path, in front of PEFT's saved tensor names


def check_attention_kwargs(attention_kwargs: Mapping[str, Any] | None) -> None:
    """Accept what changes nothing (``None``, ``{}``, ``{"scale": 1.0}``); refuse the rest by name."""
    if attention_kwargs is None:
        return
    if not isinstance(attention_kwargs, Mapping):
        raise ValueError(f"attention_kwargs must be a dict or None, got {type(attention_kwargs).__name__}")
    extra = {k: v for k, v in attention_kwargs.items() if not (k == "scale" and float(v) == 1.0)}
    if extra:
        hint = (
            " (set LoRA strengths with model.set_adapters(names, weights=[...]) instead of a call-time scale)"
            if "scale" in extra else " (this model has no attention processors to pass arguments to)"
        )
        raise ValueError(f"unsupported attention_kwargs {sorted(extra)}{hint}")


def _lora_layers(model: torch.nn.Module) -> Iterator[Any]:
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            yield module


def read_lora_file(
    source: str | os.PathLike | Mapping[str, torch.Tensor], weight_name: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """A LoRA state dict and its saved ``LoraConfig`` (or None) from a dict, a file or a folder.

    A folder is read through ``weight_name``, else diffusers' ``pytorch_lora_weights.safetensors``, else
    PEFT's ``adapter_model.safetensors``. The config is the file's ``lora_adapter_metadata`` or, failing
    that, an ``adapter_config.json`` beside the file (PEFT's layout). Keys and config come back as stored
    (any ``transformer.`` / ``base_model.model.`` prefix included).
    """
    if isinstance(source, Mapping):
        return dict(source), None
    from safetensors import safe_open

    path = Path(source).expanduser()
    if path.is_dir():
        name = weight_name or next((n for n in (LORA_WEIGHT_NAME, PEFT_WEIGHT_NAME) if (path / n).is_file()), LORA_WEIGHT_NAME)
        path = path / name
    if not path.is_file():
        raise FileNotFoundError(
            f"no LoRA file at {path}: pass a state dict, a .safetensors file or a folder holding "
            f"{weight_name or f'{LORA_WEIGHT_NAME} or {PEFT_WEIGHT_NAME}'}"
        )
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: only safetensors LoRA files are read (convert pickled weights first)")
    with safe_open(str(path), framework="pt", device="cpu") as fh:
        state = {k: fh.get_tensor(k) for k in fh.keys()}
        meta = fh.metadata() or {}
    if LORA_METADATA_KEY in meta:
        return state, json.loads(meta[LORA_METADATA_KEY])
    peft_config = path.with_name(PEFT_CONFIG_NAME)
    return state, json.loads(peft_config.read_text()) if peft_config.is_file() else None


def _under_prefix(entries: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The entries named ``prefix.<name>``, renamed ``<name>``; all of them unchanged when none is."""
    head = prefix + "."
    inner = {k[len(head):]: v for k, v in entries.items() if k.startswith(head)}
    return inner or dict(entries)


def lora_config_from_state(
    state: Mapping[str, torch.Tensor], network_alphas: Mapping[str, float] | None = None
) -> "LoraConfig":
    """Infer a PEFT ``LoraConfig`` from ``name.lora_A.weight`` / ``name.lora_B.weight`` pairs.

    Rank per module from ``lora_B``'s second dimension (the most common rank is ``r``, the others go to
    ``rank_pattern``); alpha from ``network_alphas`` when given, else equal to the rank (scale 1).
    """
    from collections import Counter

    from peft import LoraConfig

    ranks = {k[: -len(".lora_B.weight")]: int(v.shape[1]) for k, v in state.items() if k.endswith(".lora_B.weight")}
    if not ranks:
        raise ValueError("the LoRA state dict holds no '<module>.lora_B.weight' tensors (diffusers/PEFT naming expected)")
    r = Counter(ranks.values()).most_common(1)[0][0]
    alphas: dict[str, float] = {}
    for name, rank in ranks.items():
        key = next((k for k in (network_alphas or {}) if k.startswith(name + ".")), None)
        alphas[name] = float(network_alphas[key]) if key is not None else float(rank)  # type: ignore[index]
    alpha = Counter(alphas.values()).most_common(1)[0][0]
    return LoraConfig(
        r=r, lora_alpha=alpha, target_modules=sorted(ranks), lora_dropout=0.0,
        rank_pattern={n: k for n, k in ranks.items() if k != r},
        alpha_pattern={n: a for n, a in alphas.items() if a != alpha},
    )


class DiffusersCompatMixin:
    """diffusers' model surface for ``MMDiT`` (mixed into the ``nn.Module``; see the module docstring)."""

    # ---------------------------------------------------------------- pipeline hooks
    @contextlib.contextmanager
    def cache_context(self, name: str) -> Iterator[None]:
        """diffusers' ``CacheMixin.cache_context``: marks the ``cond`` / ``uncond`` branch for caching
        hooks. No hook is ever attached here (a cache would change bytes), so it only yields."""
        yield

    def enable_gradient_checkpointing(self, enabled: bool = True, *, keep_attention_outputs: bool = True) -> Any:
        """Recompute each block in backward (production and strict forwards).

        ``keep_attention_outputs`` (strict forwards with the Triton attention): each block's attention output and
        softmax statistics are kept from the forward for the recompute, which then runs no attention forward
        (same bytes; about 26 MB a block at 1024², B = 1, held until the block's backward). False recomputes
        them, for the least memory."""
        self.gradient_checkpointing = bool(enabled)
        self.keep_attention_outputs = bool(keep_attention_outputs)
        return self

    def disable_gradient_checkpointing(self) -> Any:
        self.gradient_checkpointing = False
        return self

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self, "gradient_checkpointing", False))

    # ---------------------------------------------------------------- LoRA (diffusers' PeftAdapterMixin names)
    def adapter_names(self) -> list[str]:
        """Every LoRA adapter injected in this model (whoever injected it: these methods or PEFT)."""
        return sorted({n for layer in _lora_layers(self) for n in layer.lora_A})  # type: ignore[arg-type]

    def _adapter_configs(self) -> dict[str, "LoraConfig"]:
        # PEFT assigns ``model.peft_config`` to the config of the latest injection only; keep our own.
        return self.__dict__.setdefault("_lora_configs", {})

    def add_adapter(self, adapter_config: "LoraConfig", adapter_name: str = "default") -> None:
        """Inject a new (unmerged) PEFT LoRA adapter and make it the active one."""
        from peft import inject_adapter_in_model

        if adapter_name in self.adapter_names():
            raise ValueError(f"adapter {adapter_name!r} already exists; delete_adapters() it first or pick another name")
        self.__dict__.pop("peft_config", None)  # else PEFT warns that a second adapter is being added
        inject_adapter_in_model(adapter_config, self, adapter_name=adapter_name)  # type: ignore[arg-type]
        configs = self._adapter_configs()
        configs[adapter_name] = adapter_config
        self.peft_config = dict(configs)
        self.set_adapter(adapter_name)

    def load_lora_adapter(
        self,
        pretrained_model_name_or_path_or_dict: str | os.PathLike | Mapping[str, torch.Tensor],
        prefix: str | None = "transformer",
        hotswap: bool = False,
        *,
        adapter_name: str | None = None,
        weight_name: str | None = None,
        network_alphas: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        **_loader_kwargs: Any,
    ) -> None:
        """Load a diffusers/PEFT LoRA (state dict, ``.safetensors`` file or folder) as a new adapter.

        Keys are ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``, optionally under ``prefix.``
        (what ``QwenImagePipeline.load_lora_weights`` passes) or PEFT's ``base_model.model.``. The
        ``LoraConfig`` comes from ``metadata`` or the saved config (:func:`read_lora_file`), its entries
        under ``prefix.`` when they are, else it is inferred from the tensor shapes. A PEFT adapter folder
        (``adapter_model.safetensors`` + ``adapter_config.json``) loads as it is. The new adapter becomes
        the active one; tensors are cast to the model's dtype and device.
        """
        from peft import LoraConfig
        from peft.utils import set_peft_model_state_dict

        if hotswap:
            raise ValueError("hotswap is not supported: delete_adapters() the old adapter and load the new one")
        state, saved = read_lora_file(pretrained_model_name_or_path_or_dict, weight_name)
        cfg_dict = dict(metadata) if metadata else saved
        if prefix:
            # a pipeline's file (save_lora_weights, our export) names tensors and config entries under the
            # component's prefix; a file saved by save_lora_adapter carries none
            state = _under_prefix(state, prefix)
            cfg_dict = _under_prefix(cfg_dict, prefix) if cfg_dict else cfg_dict
            if network_alphas:
                network_alphas = {k[len(prefix) + 1:] if k.startswith(prefix + ".") else k: v for k, v in network_alphas.items()}
        peft_saved = any(k.startswith(PEFT_KEY_PREFIX + ".") for k in state)
        state = _under_prefix(state, PEFT_KEY_PREFIX)  # PEFT's saved names, as set_peft_model_state_dict reads them
        bad = sorted(k for k in state if ".lora_A." not in k and ".lora_B." not in k)
        if bad:
            raise ValueError(f"not LoRA tensors (expected '.lora_A.' / '.lora_B.' names): {bad[:4]}")
        if cfg_dict:
            known = set(LoraConfig.__dataclass_fields__)
            config = LoraConfig(**{k: v for k, v in cfg_dict.items() if k in known and k not in ("peft_type", "task_type")})
            if not config.target_modules and not getattr(config, "target_parameters", None):
                raise ValueError(
                    f"the saved LoraConfig names no target_modules (its entries: {sorted(cfg_dict)[:6]}); "
                    "entries stored under a component name need prefix= set to that name"
                )
        elif peft_saved and not network_alphas:
            # PEFT keeps alpha in adapter_config.json only: inferring alpha = r would silently rescale the adapter
            raise ValueError(
                "PEFT-saved LoRA tensors came without their adapter_config.json (alpha unknown): load the adapter "
                "folder itself (model.load_lora_adapter(folder) or peft.PeftModel.from_pretrained(model, folder))"
            )
        else:
            config = lora_config_from_state(state, network_alphas)
        if getattr(config, "use_dora", False):
            raise ValueError("DoRA adapters are not supported (the strict runtime applies plain LoRA only)")
        name = adapter_name or f"default_{len(self.adapter_names())}"
        self.add_adapter(config, name)
        ref = next(iter(self.parameters()))  # type: ignore[attr-defined]
        state = {k: v.to(device=ref.device, dtype=ref.dtype) for k, v in state.items()}
        result = set_peft_model_state_dict(self, state, adapter_name=name)  # type: ignore[arg-type]
        unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        missing = [k for k in getattr(result, "missing_keys", []) if f"lora_A.{name}" in k or f"lora_B.{name}" in k]
        if unexpected or missing:
            self.delete_adapters(name)
            raise ValueError(
                f"LoRA tensors do not match this model's layers: unexpected {unexpected[:4]}, missing {missing[:4]}"
            )

    def set_adapter(self, adapter_name: str | Sequence[str]) -> None:
        """Make exactly these adapters active (the strict runtime accepts one active adapter per layer)."""
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        unknown = [n for n in names if n not in self.adapter_names()]
        if unknown:
            raise ValueError(f"unknown adapters {unknown}; loaded: {self.adapter_names()}")
        for layer in _lora_layers(self):  # type: ignore[arg-type]
            layer.set_adapter(names)

    def set_adapters(self, adapter_names: str | Sequence[str], weights: float | Sequence[float] | None = None) -> None:
        """Activate ``adapter_names`` with per-adapter strengths (``scaling = weight · alpha / r``)."""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        if weights is None:
            ws = [1.0] * len(names)
        elif isinstance(weights, (int, float)):
            ws = [float(weights)] * len(names)
        else:
            ws = [float(w) for w in weights]
        if len(ws) != len(names):
            raise ValueError(f"{len(names)} adapter names but {len(ws)} weights")
        self.set_adapter(names)
        for layer in _lora_layers(self):  # type: ignore[arg-type]
            for n, w in zip(names, ws):
                if n in layer.lora_A:
                    layer.set_scale(n, w)

    @property
    def active_adapters(self) -> list[str]:
        for layer in _lora_layers(self):  # type: ignore[arg-type]
            return list(layer.active_adapters)
        return []

    def disable_lora(self) -> None:
        """Run the base weights alone (adapters stay loaded)."""
        for layer in _lora_layers(self):  # type: ignore[arg-type]
            layer.enable_adapters(False)

    def enable_lora(self) -> None:
        for layer in _lora_layers(self):  # type: ignore[arg-type]
            layer.enable_adapters(True)

    disable_adapters = disable_lora
    enable_adapters = enable_lora

    def delete_adapters(self, adapter_names: str | Sequence[str]) -> None:
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        for n in names:
            if n not in self.adapter_names():
                raise ValueError(f"unknown adapter {n!r}; loaded: {self.adapter_names()}")
            for layer in _lora_layers(self):  # type: ignore[arg-type]
                if n in layer.lora_A:
                    layer.delete_adapter(n)
            self._adapter_configs().pop(n, None)
            self.peft_config = dict(self._adapter_configs())

    def save_lora_adapter(self, save_directory: str | os.PathLike, adapter_name: str = "default",
                          weight_name: str = LORA_WEIGHT_NAME) -> Path:
        """Write one adapter as diffusers does (``pytorch_lora_weights.safetensors`` + its LoraConfig);
        the same adapter always gives the same file bytes."""
        from peft.utils import get_peft_model_state_dict

        from ..io import save_safetensors  # byte-stable header (sorted metadata)

        config = self._adapter_configs().get(adapter_name)
        if config is None:
            raise ValueError(
                f"no LoraConfig recorded for adapter {adapter_name!r} (recorded: {sorted(self._adapter_configs())}); "
                "adapters injected directly with PEFT are saved with peft.utils.get_peft_model_state_dict"
            )
        state = get_peft_model_state_dict(self, adapter_name=adapter_name)  # type: ignore[arg-type]
        state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.to_dict().items()}
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        save_safetensors(state, out / weight_name, metadata={"format": "pt", LORA_METADATA_KEY: json.dumps(cfg, sort_keys=True, default=str)})
        return out / weight_name

    def set_attention_backend(self, backend: str) -> None:
        raise ValueError(
            f"set_attention_backend({backend!r}) is not supported: attention is chosen by the runtime "
            "(model.set_runtime('off') for PyTorch SDPA, 'strict' for the batch-invariant kernels)"
        )

    def set_attn_processor(self, processor: Any) -> None:
        raise ValueError("attention processors are not supported: attention is chosen by the runtime (model.set_runtime)")

    def fuse_lora(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            "fuse_lora is not supported: the strict runtime applies LoRA unmerged; for a merged copy use "
            "peft's merge on a runtime='off' model (layer.merge()) and save it as a new checkpoint"
        )


def diffusers_twin(model: torch.nn.Module) -> torch.nn.Module:
    """diffusers' ``QwenImageTransformer2DModel`` for ``model``'s architecture on the same parameter storage.

    The base weights are assigned, not copied (``load_state_dict(assign=True)``), so the twin costs
    no memory and always sees the current weights; a PEFT LoRA on ``model`` is injected into the twin
    with the same config and its weights copied. For side-by-side timing and parity with the peer.
    """
    from diffusers import QwenImageTransformer2DModel

    state = model.state_dict()
    base = {k.replace(".base_layer", ""): v for k, v in state.items() if "lora_" not in k}
    lora = {k: v for k, v in state.items() if "lora_" in k}
    dcfg = {k: v for k, v in model.config.to_diffusers_config().items() if not k.startswith("_")}
    with torch.device("meta"):
        twin = QwenImageTransformer2DModel(**dcfg)
    # the RoPE frequency tables are plain attributes, not buffers: rebuild them off the meta device
    twin.pos_embed = type(twin.pos_embed)(theta=10000, axes_dim=list(model.config.axes_dims_rope), scale_rope=True)
    twin.load_state_dict(base, strict=True, assign=True)
    if lora:
        from peft import inject_adapter_in_model

        for name, config in getattr(model, "peft_config", {}).items():
            inject_adapter_in_model(config, twin, adapter_name=name)
        missing = set(lora) - set(twin.state_dict())
        if missing:
            raise ValueError(f"diffusers twin has no LoRA slot for {sorted(missing)[:3]}")
        twin.to(device=next(iter(base.values())).device)
        with torch.no_grad():
            params = dict(twin.named_parameters())
            for k, v in lora.items():
                params[k].copy_(v)
    return twin.eval().requires_grad_(False)
