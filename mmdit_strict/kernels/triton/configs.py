"""Launch configurations of the strict GEMM engine, as data.

Every configuration is keyed by ``(N, K, dtype)`` of the product — the output features and the
reduction length — and never by ``M`` (tokens or batch rows): the tile shape fixes each output
element's reduction tree, so choosing it from ``M`` would make a row's bytes depend on what it is
batched with (docs/design.md §3.4).

Tables (read-only mappings of frozen dataclasses; a benchmark passes the candidates it times as
the ``config=`` argument of ``gemm_fwd`` / ``gemm_bwd`` / ``gemm_dw`` and never edits them):

* :data:`FWD` — :class:`FwdConfig` of the main kernel ``out(M, N) = p(a)(M, K) @ b(K, N)``, used for
  the forward product and for ``dX = dZ @ W`` (there ``N`` and ``K`` are the layer's ``K`` and ``N``).
  ``weight_layout`` says how the forward reads the weight: ``"kn"`` = a contiguous ``Wᵀ (K, N)``
  copy owned by the weight tensor (made once per weight version, see ``gemm.weights``), ``"nk"`` =
  nn.Linear's stored ``(N, K)`` read in place — with ``tma`` through a tensor descriptor whose
  ``(BLOCK_N, BLOCK_K)`` boxes are transposed in shared memory before the same ``tl.dot``, so the
  bytes equal the ``"kn"`` bytes of the same tile (tests/kernels/test_triton_gemm.py checks this);
  without ``tma`` through strides. The forward of every Qwen-Image class but ``img_in`` / ``proj_out``
  reads ``"nk"`` (timed on the H200 against the copy, same bytes, 0.91–1.03× its speed; see the
  ``_IN_PLACE_BF16`` table below), so no second copy of those weights exists; ``img_in`` and
  ``proj_out`` keep their 0.4 MiB copies (``"nk"`` measured 0.97–0.98×).
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


# Qwen-Image layer shapes (N, K), as the strict model runs them (bench/gemm_shapes.py reads them from a
# forward): q, k, v, attn_out and timestep-2 3072×3072 (three separate Q/K/V products: one fused 9216-wide
# product timed 0.360 ms vs 3 × 0.1206 ms on the H200 at bb1b941, no gain for a concatenated weight copy), mlp_up 12288×3072,
# mlp_down 3072×12288, modulation 18432×3072, final modulation 6144×3072, txt_in 3072×3584,
# img_in 3072×64, proj_out 64×3072, timestep-1 3072×256.  Backward dX uses the transposed pairs.
# H200 run 1 (experiments/gemm/h200_gemm_report_run1.md): 128×256×64, 8 warps, 4 stages was the best
# of six candidates for qkv/mlp_up/mlp_down fwd and dX; the N×K weight read cost 15–35%.
# Round 2 (experiments/gemm/h200_tuning_round2.md): the same tile through tensor descriptors (TMA) was
# the fastest of 7 candidates for every M = 4224 class, fwd and dX (0.96–1.14× cuBLAS in the sweep).
# Round 5 (experiments/gemm/h200_round5_ee52edf.md): the same tile walked by one persistent program
# per SM (the next tile's operands load during this tile's epilogue), the epilogue on two column
# halves leaving through the copy engine, 3 stages (room for the store buffer): the fastest of four
# candidates in CUDA-graph time for every M = 4224 class without GELU (1–5 % over the plain launch).
_BIG_BF16 = FwdConfig(128, 256, 64, 8, 3, tma=True, persistent=True, epi_split=2, tma_store=True)
# Rounds 4–5, the tanh-GELU class (mlp_up fwd, mlp_down dX): persistent with the epilogue on two
# column halves, 4 stages, pointer stores (the TMA store variant was 5 % slower here); with the Newton
# division (round 4: 255 registers / 18 spilled under div.rn) mlp_up fwd went from 0.581 to 0.547 ms.
_BIG_GELU_BF16 = FwdConfig(128, 256, 64, 8, 4, tma=True, persistent=True, epi_split=2)
# M = batch rows (1..2048): weight-streaming bound. Run 2's sweep (prologue fused into the main loop):
# time grew with the number of column tiles (16×32×128 0.32 ms, 16×64×64 0.18, 16×128×64 0.15) — every
# program re-evaluated SiLU on its whole (16, K) row block; round 2 runs the prologue as its own pass.
# Round-2 sweep at M = 8 (prologue pass): 16×256×64 w8 s4 0.047 ms vs cuBLAS+SiLU 0.045 ms for 18432×3072.
_MOD_BF16 = FwdConfig(16, 256, 64, 8, 4)
# 6144×3072: every candidate timed 0.081–0.094 ms in the sweep (host launch bound, see NOTES.md);
# 16×64×128 (96 programs) was the fastest, 0.046 ms in the speed section after it.
_FINAL_MOD_BF16 = FwdConfig(16, 64, 128, 4, 4)
# dX of the modulation projections (M = batch rows, N = 3072 outputs, K = 18432/6144): without
# split-K the parallelism is N / BLOCK_N programs, so narrow tiles.
_MOD_DX_BF16 = FwdConfig(16, 32, 128, 4, 6)  # round 2: stages 4 → 6 (0.061 → 0.052 ms at M = 8)
_THIN_N_BF16 = FwdConfig(64, 64, 64, 4, 4)         # N = 64 (proj_out fwd, img_in dX): 33 programs at BLOCK_M 128 was too few
_THIN_K_BF16 = FwdConfig(128, 128, 64, 8, 3)       # K = 64 (img_in): one K step

_FWD: dict[tuple[int, int, str], FwdConfig] = {
    (3072, 3072, _BF16): _BIG_BF16,
    (12288, 3072, _BF16): _BIG_GELU_BF16,  # mlp_up fwd (bias + tanh-GELU) and mlp_down dX
    (3072, 12288, _BF16): _BIG_BF16,
    (3072, 3584, _BF16): _BIG_BF16,
    (3584, 3072, _BF16): _BIG_BF16,        # dX of txt_in
    (18432, 3072, _BF16): _MOD_BF16,
    (6144, 3072, _BF16): _FINAL_MOD_BF16,
    (3072, 18432, _BF16): _MOD_DX_BF16,    # dX of the modulation projection
    (3072, 6144, _BF16): _MOD_DX_BF16,
    (3072, 64, _BF16): _THIN_K_BF16,
    (64, 3072, _BF16): _THIN_N_BF16,
}

# Tuning probe (experiments/gemm/h200_tuning_071631c.md): 64×128×32 w4 s3 was the fastest of eight FP32
# (IEEE FMA) tiles on attn_out and mlp_up (0.87 / 0.90 of cuBLAS vs 0.85 / 0.87 for 128×128×32 w8 s3).
_BIG_FP32 = FwdConfig(64, 128, 32, 4, 3)
_MOD_FP32 = FwdConfig(16, 64, 64, 4, 4)
_MOD_DX_FP32 = FwdConfig(16, 32, 64, 4, 4)
_THIN_N_FP32 = FwdConfig(64, 64, 32, 4, 3)
_FP32_OF = {_MOD_BF16: _MOD_FP32, _FINAL_MOD_BF16: _MOD_FP32, _THIN_N_BF16: _THIN_N_FP32, _MOD_DX_BF16: _MOD_DX_FP32}
_FWD.update({(_n, _k, _FP32): _FP32_OF.get(_cfg, _BIG_FP32) for (_n, _k, _d), _cfg in list(_FWD.items())})
# FP32 products of text rows (128-512 a call): the 64x128 tile left 96-112 programs on 132 SMs. A 32x64 tile with
# the same 32-wide K step gives each output element the same accumulator chain (bytes equal to the 64x128 tile's in
# every case below, and in the GPU test). H200, 256 rows (benchmarks/gemv_probe, experiments/gemm/gemv_probe_45482cd):
# txt_in forward (3072, 3584) 0.302 -> 0.165 ms (cuBLAS FP32, TF32 off: 0.203), its dX (3584, 3072) 0.257 -> 0.180;
# the text stream's q/k/v and attn_out (3072, 3072) 0.257 -> 0.138, txt_mlp down (3072, 12288) 1.015 -> 0.541.
_TEXT_FP32 = FwdConfig(32, 64, 32, 4, 3)
_FWD[(3072, 3584, _FP32)] = _TEXT_FP32
_FWD[(3584, 3072, _FP32)] = _TEXT_FP32
# The forward reads W (N, K) in place instead of a prepacked Wᵀ copy (H200 at bb1b941,
# experiments/gemm/h200_layouts_bb1b941.md; bytes equal to the copy's in every class): q/k/v 0.998×,
# attn_out 1.004×, mlp_up 1.029×, mlp_down 1.012×, txt_in 0.999× the copy's speed; the modulation
# projection through descriptors 0.912× (3 µs of a 0.032 ms kernel, 120 calls per forward ≈ 0.4 ms, for
# 12.7 GiB of copies at Qwen-Image size), final modulation 1.031×. Only the forward reads
# ``weight_layout``; dX always reads W as stored. The two modulation keys serve no dX product, so their
# ``tma`` flag changes only the forward. img_in / proj_out keep their 0.4 MiB copies (nk 0.97–0.98×).
_IN_PLACE_BF16 = {(3072, 3072): False, (12288, 3072): False, (3072, 12288): False,
                  (3072, 3584): False, (18432, 3072): True, (6144, 3072): True}
for (_n, _k), _tma in _IN_PLACE_BF16.items():
    _FWD[(_n, _k, _BF16)] = _FWD[(_n, _k, _BF16)].replace(weight_layout="nk", tma=_FWD[(_n, _k, _BF16)].tma or _tma)
# The text stream (prompt rows: 128-256 per sample, against 4096+ image rows) through the same (N, K) classes
# as the image stream. At those rows the image stream's 128x256 tile leaves 12-24 programs on 132 SMs
# (experiments/gemm/8a2787d: 0.24-0.30x cuBLAS). A 64x128 tile with the same 64-wide K step gives each output
# element the same accumulator chain, hence the same bytes (the H200 text sweep at 9b01937 compared every
# candidate's output with the incumbent's at 128/144/256 rows: equal), and ran 2.8x (q/k/v, attn_out), 2.0x
# (mlp_down) and 2.9x (txt_in) faster there. mlp_up keeps the image tile (the fastest at 144 and 256 rows).
# The stream is where a product sits in the model, set by the caller (``streams.gemm_stream``), never
# derived from the number of rows.
_TEXT_BF16 = FwdConfig(64, 128, 64, 4, 4, weight_layout="nk", tma=True)
_FWD[(3072, 3584, _BF16)] = _TEXT_BF16  # txt_in: its forward serves text rows only
FWD: Mapping[tuple[int, int, str], FwdConfig] = MappingProxyType(_FWD)
FWD_TEXT: Mapping[tuple[int, int, str], FwdConfig] = MappingProxyType({
    (3072, 3072, _BF16): _TEXT_BF16,   # q, k, v (added projections), to_add_out
    (3072, 12288, _BF16): _TEXT_BF16,  # txt_mlp down
    (3072, 3072, _FP32): _TEXT_FP32,
    (3072, 12288, _FP32): _TEXT_FP32,
})

_DW_BF16 = DwConfig(128, 128, 64, 8, 3)
_DW_FP32 = DwConfig(64, 64, 32, 4, 3)
# Tuning probe (h200_tuning_071631c.md), one 4224-row sample: 128×256 output tiles over 64-row chunks,
# 4 stages, 0.71–0.73 of cuBLAS for the wide layers (0.64–0.66 with the size class); the row chunking
# (BLOCK_M, the per-sample tree) is unchanged. attn_out's square gradient keeps 128×128, 4 stages.
_DW_WIDE_BF16 = DwConfig(128, 256, 64, 8, 4)
DW: Mapping[tuple[int, int, str], DwConfig] = MappingProxyType({
    (12288, 3072, _BF16): _DW_WIDE_BF16,   # mlp_up
    (3072, 12288, _BF16): _DW_WIDE_BF16,   # mlp_down
    (3072, 3584, _BF16): _DW_WIDE_BF16,    # txt_in (not probed; measured by the qualification)
    (3072, 3072, _BF16): DwConfig(128, 128, 64, 8, 4),  # attn_out
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
