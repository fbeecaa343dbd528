"""Launch configurations of the strict GEMM engine, as data.

Every configuration is keyed by ``(N, K, dtype)`` of the product — the output features and the
reduction length — and never by ``M`` (tokens or batch rows): the tile shape fixes each output
element's reduction tree, so choosing it from ``M`` would make a row's bytes depend on what it is
batched with (docs/design.md §3.4).

Tables (read-only mappings of frozen dataclasses written as literal entries; a benchmark passes the
candidates it times as the ``config=`` argument of ``gemm_fwd`` / ``gemm_dw``, or ``dx_config=`` of
``gemm_bwd``, and never edits them):

* :data:`FWD` — :class:`FwdConfig` of the main kernel ``out(M, N) = p(a)(M, K) @ b(K, N)``, used for
  the forward product and for ``dX = dZ @ W`` (there ``N`` and ``K`` are the layer's ``K`` and ``N``).
  ``weight_layout`` says how the forward reads the weight: ``"kn"`` = a contiguous ``Wᵀ (K, N)``
  copy owned by the weight tensor (made once per weight version, see ``gemm.weights``), ``"nk"`` =
  nn.Linear's stored ``(N, K)`` read in place — with ``tma`` through a tensor descriptor whose
  ``(BLOCK_N, BLOCK_K)`` boxes are transposed in shared memory before the same ``tl.dot``, so the
  bytes equal the ``"kn"`` bytes of the same tile (tests/kernels/test_triton_gemm.py checks this);
  without ``tma`` through strides. The BF16 forward of every Qwen-Image class but ``img_in`` / ``proj_out``
  and txt_in's dX reads ``"nk"``, so no second copy of those weights exists; ``img_in`` and ``proj_out``
  keep their 0.4 MiB copies.
* :data:`FWD_TEXT` — the text stream's forward tiles where they differ from :data:`FWD` (same K step,
  so the same bytes; chosen by where the product sits in the model, never by M).
* :data:`DW` — :class:`DwConfig` of the weight-gradient kernel ``dW(N, K) = Σ_samples Σ_rows dZᵀ p(x)``:
  output tile ``(BLOCK_N, BLOCK_K)``, rows consumed ``BLOCK_M`` at a time from each sample's first row.
* Generic fallbacks by size class of ``(N, K)`` when a shape has no exact entry, and the fixed
  launches of the bias-gradient kernel (:data:`DB`) and the elementwise passes (:data:`ELEMENTWISE`).

Changing any entry changes the bytes the engine produces for that shape class (a new kernel
identity in the trace); it never changes whether they are batch-invariant.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType

import torch

from ..streams import STREAMS

_BF16 = "bf16"
_FP32 = "fp32"


@dataclass(frozen=True)
class FwdConfig:
    """One configuration of the main kernel. Tile fields fix the reduction tree; the rest moves no
    arithmetic (same bytes, other speed)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int  #: K step of the one accumulator chain per output element
    num_warps: int
    num_stages: int
    weight_layout: str = "kn"  #: forward weight read: "kn" (owned Wᵀ copy) or "nk" (W as stored)
    GROUP_M: int = 8  #: grouped tile order (L2 reuse)
    tma: bool = False  #: tiles through Hopper tensor descriptors (pointer loads where the copy engine cannot serve)
    prologue: str = "pass"  #: SiLU prologue as its own elementwise pass ("pass") or in the main loop ("fused")
    tma_store: bool = False  #: the output leaves through a tensor descriptor (with tma)
    epi_split: int = 1  #: the epilogue on 1, 2 or 4 column parts of the tile
    persistent: bool = False  #: one program per SM walks the tiles

    def replace(self, **changes) -> FwdConfig:
        """A copy with ``changes`` (e.g. ``cfg.replace(weight_layout="nk")`` for a benchmark candidate)."""
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DwConfig:
    """One configuration of the weight-gradient kernel: output tile (BLOCK_N, BLOCK_K), each sample's
    rows consumed BLOCK_M at a time from its first row (the per-sample tree)."""

    BLOCK_N: int
    BLOCK_K: int
    BLOCK_M: int
    num_warps: int
    num_stages: int
    GROUP_N: int = 8

    def replace(self, **changes) -> DwConfig:
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DbConfig:
    """The bias-gradient kernel: BLOCK_N features per program, rows summed BLOCK_M at a time."""

    BLOCK_N: int
    BLOCK_M: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ElementwiseConfig:
    """The elementwise passes (prologue, dZ = dY · act'(Z)): BLOCK elements per program."""

    BLOCK: int
    num_warps: int


# Tiles, by the classes of Qwen-Image products that take them. Measurements: experiments/gemm/.
# BF16, M = 4224-class image rows: one persistent program per SM walks 128 x 256 tiles through tensor descriptors,
# the epilogue on two column halves; the tanh-GELU class keeps pointer stores and 4 stages.
_BIG_BF16 = FwdConfig(128, 256, 64, 8, 3, tma=True, persistent=True, epi_split=2, tma_store=True)  # reads the owned Wᵀ
_BIG_BF16_NK = FwdConfig(128, 256, 64, 8, 3, weight_layout="nk", tma=True, persistent=True, epi_split=2, tma_store=True)
_BIG_GELU_BF16_NK = FwdConfig(128, 256, 64, 8, 4, weight_layout="nk", tma=True, persistent=True, epi_split=2)
# BF16 text rows (128-256 a sample): a 64 x 128 tile with the image tile's 64-wide K step, so the same accumulator
# chain per output element (the same bytes) on more programs.
_TEXT_BF16 = FwdConfig(64, 128, 64, 4, 4, weight_layout="nk", tma=True)
# BF16, M = batch rows (weight-streaming bound): the modulation projections and their dX; the SiLU prologue runs
# as its own elementwise pass. dX has N / BLOCK_N programs (no split-K), hence narrow tiles.
_MOD_BF16_NK = FwdConfig(16, 256, 64, 8, 4, weight_layout="nk", tma=True)
_FINAL_MOD_BF16_NK = FwdConfig(16, 64, 128, 4, 4, weight_layout="nk", tma=True)
_MOD_DX_BF16 = FwdConfig(16, 32, 128, 4, 6)
_THIN_K_BF16 = FwdConfig(128, 128, 64, 8, 3)  # K = 64 (img_in): one K step
# N = 64 (proj_out fwd, img_in dX, and a rank-64 LoRA's u = x Aᵀ and v = dZ B): more programs than BLOCK_M 128; six
# stages keep the long K loop fed (0.021 → 0.018 ms at K = 3072, 0.098 → 0.055 ms at K = 12288 where the size class
# ran 128 × 128 tiles; the same bytes: experiments/gemm/d604caf_lora_tiles)
_THIN_N_BF16 = FwdConfig(64, 64, 64, 4, 6)
# FP32 (IEEE FMA): the text tile keeps the big tile's 32-wide K step (the same bytes) on more programs.
_BIG_FP32 = FwdConfig(64, 128, 32, 4, 3)
_TEXT_FP32 = FwdConfig(32, 64, 32, 4, 3)
_MOD_FP32 = FwdConfig(16, 64, 64, 4, 4)
_MOD_DX_FP32 = FwdConfig(16, 32, 64, 4, 4)
_THIN_N_FP32 = FwdConfig(64, 64, 32, 4, 3)
# the text stream's rank-64 LoRA products: the thin tiles' K steps on 16-row tiles
_TEXT_THIN_N_BF16 = FwdConfig(16, 64, 64, 4, 4)
_TEXT_THIN_N_FP32 = FwdConfig(16, 64, 32, 4, 3)

# Keys (N, K, dtype) of the Qwen-Image layers as the strict model runs them (bench/gemm_shapes.py reads them from a
# forward); dX products look up their transposed pair (K, N).
FWD: Mapping[tuple[int, int, str], FwdConfig] = MappingProxyType({
    (3072, 3072, _BF16): _BIG_BF16_NK,         # q, k, v, attn_out, timestep-2 (and their dX)
    (12288, 3072, _BF16): _BIG_GELU_BF16_NK,   # mlp_up fwd (bias + tanh-GELU) and mlp_down dX
    (3072, 12288, _BF16): _BIG_BF16_NK,        # mlp_down fwd, mlp_up dX
    (3072, 3584, _BF16): _TEXT_BF16,           # txt_in: its forward serves text rows only
    (3584, 3072, _BF16): _BIG_BF16,            # dX of txt_in
    (18432, 3072, _BF16): _MOD_BF16_NK,        # block modulation
    (6144, 3072, _BF16): _FINAL_MOD_BF16_NK,   # final modulation
    (3072, 18432, _BF16): _MOD_DX_BF16,        # dX of the block modulation
    (3072, 6144, _BF16): _MOD_DX_BF16,         # dX of the final modulation
    (3072, 64, _BF16): _THIN_K_BF16,           # img_in
    (64, 3072, _BF16): _THIN_N_BF16,           # proj_out; rank-64 LoRA u (K = 3072) and v (N = 3072)
    (64, 12288, _BF16): _THIN_N_BF16,          # rank-64 LoRA u of mlp_down (K = 12288), v of mlp_up (N = 12288)
    (3072, 3072, _FP32): _BIG_FP32,
    (12288, 3072, _FP32): _BIG_FP32,
    (3072, 12288, _FP32): _BIG_FP32,
    (3072, 3584, _FP32): _TEXT_FP32,
    (3584, 3072, _FP32): _TEXT_FP32,
    (18432, 3072, _FP32): _MOD_FP32,
    (6144, 3072, _FP32): _MOD_FP32,
    (3072, 18432, _FP32): _MOD_DX_FP32,
    (3072, 6144, _FP32): _MOD_DX_FP32,
    (3072, 64, _FP32): _BIG_FP32,
    (64, 3072, _FP32): _THIN_N_FP32,
    (64, 12288, _FP32): _THIN_N_FP32,
})
FWD_TEXT: Mapping[tuple[int, int, str], FwdConfig] = MappingProxyType({
    (3072, 3072, _BF16): _TEXT_BF16,   # q, k, v (added projections), to_add_out
    (3072, 12288, _BF16): _TEXT_BF16,  # txt_mlp down
    (3072, 3072, _FP32): _TEXT_FP32,
    (3072, 12288, _FP32): _TEXT_FP32,
    # a rank-64 LoRA's u and v over prompt rows: 16-row tiles give 5-20 programs where 64-row tiles gave 2-5
    (64, 3072, _BF16): _TEXT_THIN_N_BF16,
    (64, 12288, _BF16): _TEXT_THIN_N_BF16,
    (64, 3072, _FP32): _TEXT_THIN_N_FP32,
    (64, 12288, _FP32): _TEXT_THIN_N_FP32,
})

_DW_BF16 = DwConfig(128, 128, 64, 8, 3)
_DW_FP32 = DwConfig(64, 64, 32, 4, 3)
_DW_WIDE_BF16 = DwConfig(128, 256, 64, 8, 4)  # 128 x 256 output tiles; rows still consumed 64 at a time
DW: Mapping[tuple[int, int, str], DwConfig] = MappingProxyType({
    (12288, 3072, _BF16): _DW_WIDE_BF16,   # mlp_up
    (3072, 12288, _BF16): _DW_WIDE_BF16,   # mlp_down
    (3072, 3584, _BF16): _DW_WIDE_BF16,    # txt_in
    (3072, 3072, _BF16): DwConfig(128, 128, 64, 8, 4),  # attn_out
    # rank-64 LoRA gradients: dA (64, K) and dB (N, 64) have few output tiles; narrower ones fill more SMs with the
    # same 64-row chain per element (the same bytes: experiments/gemm/d604caf_lora_tiles)
    (64, 3072, _BF16): DwConfig(64, 32, 64, 4, 4),
    (3072, 64, _BF16): DwConfig(64, 32, 64, 4, 4),
    (64, 12288, _BF16): DwConfig(64, 64, 64, 4, 4),
    (12288, 64, _BF16): DwConfig(64, 64, 64, 4, 4),
})
DB = DbConfig(BLOCK_N=128, BLOCK_M=32, num_warps=4, num_stages=2)
ELEMENTWISE = ElementwiseConfig(BLOCK=1024, num_warps=4)


def _size_class_fwd(n: int, k: int, dt: str) -> FwdConfig:
    if n <= 256 and k <= 256:  # tiny layers (CI's tiny model, tests): small tiles, many of them
        return FwdConfig(16, 32, 16, 4, 2, GROUP_M=4)
    if dt == _BF16:
        return FwdConfig(128, 128, 64, 8, 3)
    return FwdConfig(64, 64, 32, 4, 3)


def _size_class_dw(n: int, k: int, dt: str) -> DwConfig:
    if n <= 256 and k <= 256:
        return DwConfig(32, 16, 16, 4, 2, GROUP_N=4)
    return _DW_BF16 if dt == _BF16 else _DW_FP32


def dtype_name(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16:
        return _BF16
    if dtype == torch.float32:
        return _FP32
    raise ValueError(f"strict GEMM engine runs fp32 or bf16, got {dtype}")


def fwd_config(n: int, k: int, dtype: torch.dtype, stream: str = "image") -> FwdConfig:
    """Configuration of the main kernel for an ``(M, K) @ (K, N)`` product of ``stream`` (``"image"`` or
    ``"text"``: :data:`FWD_TEXT` first, then :data:`FWD`); never depends on M."""
    if stream not in STREAMS:
        raise ValueError(f"GEMM stream must be one of {STREAMS}, got {stream!r}")
    dt = dtype_name(dtype)
    return (stream == "text" and FWD_TEXT.get((n, k, dt))) or FWD.get((n, k, dt)) or _size_class_fwd(n, k, dt)


def dw_config(n: int, k: int, dtype: torch.dtype) -> DwConfig:
    """Configuration of the weight-gradient kernel for a ``(N, K)`` gradient; never depends on M."""
    dt = dtype_name(dtype)
    return DW.get((n, k, dt)) or _size_class_dw(n, k, dt)
