"""Typed architecture contract of the Qwen-Image MMDiT (docs/design.md §2).

``qwen-image`` is the pinned 20B model; ``tiny`` is the same architecture at sizes a 2-core CPU runs
in seconds. Field names follow diffusers' ``QwenImageTransformer2DModel`` config so that a
``config.json`` written by ``save_pretrained`` maps onto :class:`ArchConfig` one to one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

# Wan/Qwen-Image VAE latent statistics (16 channels), as in the VAE's config.json.
QWEN_LATENTS_MEAN: tuple[float, ...] = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)
QWEN_LATENTS_STD: tuple[float, ...] = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)


@dataclass(frozen=True)
class ArchConfig:
    """Architecture of one double-stream MMDiT.

    Attributes:
        patch_size: side of the square latent patch packed into one token (2 → 2×2).
        in_channels: values per packed image token (latent_channels × patch_size²).
        out_channels: latent channels predicted per pixel of the patch (16).
        num_layers: number of double-stream blocks.
        attention_head_dim: width of one attention head.
        num_attention_heads: heads per block; hidden size = heads × head_dim.
        joint_attention_dim: width of the prompt embeddings (the text encoder's hidden size).
        axes_dims_rope: RoPE channels per axis (frame, height, width); sums to attention_head_dim.
        rope_theta: RoPE base.
        eps: epsilon of every LayerNorm / RMSNorm.
        mlp_ratio: MLP hidden = mlp_ratio × hidden size.
        timestep_channels: sinusoid channels of the timestep embedding.
        timestep_scale: multiplier applied to sigma before the sinusoid.
        latent_channels: VAE latent channels (16).
        latents_mean: per-channel mean used by latent normalize.
        latents_std: per-channel std used by latent normalize (std_inv = 1 / std).
    """

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    rope_theta: int = 10000
    eps: float = 1e-6
    mlp_ratio: int = 4
    timestep_channels: int = 256
    timestep_scale: float = 1000.0
    latent_channels: int = 16
    latents_mean: tuple[float, ...] = QWEN_LATENTS_MEAN
    latents_std: tuple[float, ...] = QWEN_LATENTS_STD

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dims_rope", tuple(int(a) for a in self.axes_dims_rope))
        object.__setattr__(self, "latents_mean", tuple(float(a) for a in self.latents_mean))
        object.__setattr__(self, "latents_std", tuple(float(a) for a in self.latents_std))
        problems = []
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            problems.append(
                f"axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim {self.attention_head_dim}"
            )
        if any(a % 2 for a in self.axes_dims_rope):
            problems.append(f"every entry of axes_dims_rope must be even, got {self.axes_dims_rope}")
        if self.in_channels != self.out_channels * self.patch_size**2:
            problems.append(
                f"in_channels ({self.in_channels}) must equal out_channels × patch_size² "
                f"({self.out_channels} × {self.patch_size}²)"
            )
        if self.out_channels != self.latent_channels:
            problems.append(f"out_channels ({self.out_channels}) must equal latent_channels ({self.latent_channels})")
        if len(self.latents_mean) != self.latent_channels or len(self.latents_std) != self.latent_channels:
            problems.append(f"latents_mean and latents_std need {self.latent_channels} entries each")
        for name in ("num_layers", "attention_head_dim", "num_attention_heads", "joint_attention_dim"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if problems:
            raise ValueError("invalid ArchConfig: " + "; ".join(problems))

    @property
    def hidden_size(self) -> int:
        """Model width (3072 for Qwen-Image)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden(self) -> int:
        """MLP inner width (12288 for Qwen-Image)."""
        return self.mlp_ratio * self.hidden_size

    # diffusers reads these flags off ``transformer.config``; variants that set them are refused at load.
    @property
    def guidance_embeds(self) -> bool:
        return False

    @property
    def zero_cond_t(self) -> bool:
        return False

    @property
    def use_additional_t_cond(self) -> bool:
        return False

    @property
    def use_layer3d_rope(self) -> bool:
        return False

    def get(self, key: str, default: Any = None) -> Any:
        """Dict-style read, as on diffusers' ``FrozenDict`` configs (``config.get("in_channels")``)."""
        return getattr(self, key, default)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["axes_dims_rope"] = list(self.axes_dims_rope)
        d["latents_mean"] = list(self.latents_mean)
        d["latents_std"] = list(self.latents_std)
        return d

    def to_diffusers_config(self) -> dict[str, Any]:
        """The ``config.json`` diffusers' QwenImageTransformer2DModel expects for this architecture."""
        return {
            "_class_name": "QwenImageTransformer2DModel",
            "patch_size": self.patch_size,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "num_layers": self.num_layers,
            "attention_head_dim": self.attention_head_dim,
            "num_attention_heads": self.num_attention_heads,
            "joint_attention_dim": self.joint_attention_dim,
            "guidance_embeds": False,
            "axes_dims_rope": list(self.axes_dims_rope),
        }

    @classmethod
    def from_diffusers_config(cls, cfg: Mapping[str, Any]) -> "ArchConfig":
        """Build from a diffusers ``config.json``; variants outside Phase A are refused."""
        for flag in ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
            if cfg.get(flag):
                raise ValueError(f"checkpoint config sets {flag}=true: this variant is outside the Qwen-Image Phase A contract")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in cfg:
                kwargs[f.name] = cfg[f.name]
        if kwargs.get("out_channels") is None:
            kwargs["out_channels"] = int(cfg.get("in_channels", 64)) // int(cfg.get("patch_size", 2)) ** 2
        return cls(**kwargs)


PRESETS: dict[str, ArchConfig] = {
    "qwen-image": ArchConfig(),
    # Same graph, CPU-sized: 2 blocks, 2 heads × 16, prompt width 48.
    "tiny": ArchConfig(
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=48,
        axes_dims_rope=(4, 6, 6),
    ),
}


def preset(name: str) -> ArchConfig:
    """Return a named architecture preset (``qwen-image`` or ``tiny``)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None


def arch_field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(ArchConfig)]


__all__ = ["ArchConfig", "PRESETS", "preset", "QWEN_LATENTS_MEAN", "QWEN_LATENTS_STD", "arch_field_names"]
