"""The K-split linear arithmetic: the one-rank product that row-parallel tensor parallelism would need.

Row-parallel TP splits a layer's reduction length ``K`` over ``t`` ranks and adds their partial
products. Its bytes equal one rank's only if one rank computes the same sum in the same order, so
this module writes that arithmetic down as one function of ``t`` (it is *not* the model's arithmetic;
``docs/parallel.md``, "Row-parallel TP", says why the model uses the all-gather formulation instead)::

    K_j = [j·K/t, (j+1)·K/t)                         t equal contiguous chunks, j = 0 … t−1
    P_j = X[:, K_j] · W[:, K_j]ᵀ                      (M, N), FP32: one strict GEMM per chunk, never rounded
    S   = tree(P_0, …, P_{t−1})                       the fixed pairwise tree of :mod:`.fold_tree`
    y   = cast(S + b)                                 bias added once in FP32, one cast to x's dtype

The tree is the canonical dyadic one (``t = 4``: ``(P_0 + P_1) + (P_2 + P_3)``); it depends on ``t``
only, never on M or the batch, and every contiguous range of chunks reduces to complete subtrees, so
ranks owning consecutive chunks can each fold their own and exchange the nodes. ``t = 1`` is the
unsplit product with its epilogue moved out of the kernel: the same FP32 operations in the same order.

Engines (each chunk product ``P_j``):

* ``"triton"``: the strict Triton GEMM engine (``gemm_fwd`` with ``out_dtype=torch.float32``), every
  chunk under the *whole* layer's configuration ``configs.fwd_config(N, K, dtype, stream)``, so a rank
  holding one chunk reproduces ``P_j`` by running that configuration on it. Each chunk must be a
  multiple of the configuration's ``BLOCK_K`` (the chunk's K loop is then whole steps). CUDA, or CPU
  tensors under ``TRITON_INTERPRET=1``. FP32 or BF16 operands; partials always FP32.
* ``"cpu"``: the CPU strict engine's fixed-tile product (:func:`.cpu.primitives.tile_matmul`) per
  chunk, FP32 only (the CPU strict backend is qualified for FP32). No K-step condition.

The sums, the bias and the cast are elementwise torch operations (IEEE FP32 adds, round-to-nearest
cast), the same on both engines.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .fold_tree import fold

ENGINES = ("triton", "cpu")
SPLITS = (1, 2, 4, 8)  #: the split counts the benchmark measures (any t ≥ 1 that divides K works)


def chunk_bounds(k: int, t: int, step: int = 1) -> list[tuple[int, int]]:
    """The ``t`` contiguous ``[start, stop)`` ranges of ``range(k)``, equal in size.

    ValueError when ``t`` is not a positive int dividing ``k`` or a chunk is not a multiple of ``step``
    (the GEMM engine's K step)."""
    if not isinstance(t, int) or isinstance(t, bool) or t < 1:
        raise ValueError(f"K-split: t must be a positive int, got {t!r}")
    if k % t:
        raise ValueError(f"K-split: t = {t} does not divide K = {k}")
    size = k // t
    if size % step:
        raise ValueError(f"K-split: chunks of K / t = {k} / {t} = {size} are not a multiple of the GEMM's K step {step}")
    return [(j * size, (j + 1) * size) for j in range(t)]


def tree_sum(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """The fixed pairwise tree of ``partials`` (leaves in chunk order; :func:`.fold_tree.fold`).

    The inputs are not modified. One partial comes back as itself."""
    if not partials:
        raise ValueError("K-split: no partial products to sum")
    out = fold(partials)
    if out is None:
        raise ValueError("K-split: the partial products must be tensors")
    return out


def split_weight(weight: torch.Tensor, t: int) -> list[torch.Tensor]:
    """``weight (N, K)`` cut into ``t`` contiguous ``(N, K/t)`` column blocks (what tensor rank j would hold)."""
    if weight.dim() != 2:
        raise ValueError(f"K-split: expected weight of shape (N, K), got {tuple(weight.shape)}")
    return [weight[:, a:b].contiguous() for a, b in chunk_bounds(weight.shape[1], t)]


def default_engine(x: torch.Tensor) -> str:
    """``"triton"`` for CUDA tensors, ``"cpu"`` otherwise."""
    return "triton" if x.device.type == "cuda" else "cpu"


def layer_config(n: int, k: int, dtype: torch.dtype, stream: str = "image"):
    """The Triton configuration every chunk of an ``(N, K)`` layer runs: the whole layer's."""
    from .triton import configs

    return configs.fwd_config(n, k, dtype, stream=stream)


def _check(x: torch.Tensor, chunks: Sequence[torch.Tensor], bias: torch.Tensor | None, engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"K-split: engine must be one of {ENGINES}, got {engine!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"K-split: expected x of shape (M, K), got {getattr(x, 'shape', type(x).__name__)}")
    kc = x.shape[1] // len(chunks)
    n = chunks[0].shape[0] if chunks[0].dim() == 2 else -1
    for j, c in enumerate(chunks):
        if c.dim() != 2 or tuple(c.shape) != (n, kc):
            raise ValueError(f"K-split: expected weight chunk {j} of shape ({n}, {kc}), got {tuple(c.shape)}")
        if c.dtype != x.dtype or c.device != x.device:
            raise ValueError(f"K-split: weight chunk {j} is {c.dtype} on {c.device}, x is {x.dtype} on {x.device}")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"K-split: expected bias of shape ({n},) {x.dtype} on {x.device}, "
                         f"got {tuple(bias.shape)} {bias.dtype} on {bias.device}")
    allowed = (torch.float32,) if engine == "cpu" else (torch.float32, torch.bfloat16)
    if x.dtype not in allowed:
        raise ValueError(f"K-split: the {engine} engine runs {', '.join(str(d) for d in allowed)}, got {x.dtype}")


def chunk_product(x_chunk: torch.Tensor, w_chunk: torch.Tensor, *, engine: str, config=None) -> torch.Tensor:
    """One partial ``x_chunk (M, Kc) · w_chunk (N, Kc)ᵀ`` → ``(M, N)`` FP32, no bias, never rounded.

    ``x_chunk`` may be a column view of a wider ``x`` (row stride K, unit column stride); ``w_chunk``
    must be contiguous. ``config``: the Triton configuration (the whole layer's, see :func:`layer_config`)."""
    if engine == "cpu":
        from .cpu.primitives import tile_matmul

        return tile_matmul(x_chunk, w_chunk.t())
    from .triton.gemm import gemm_fwd

    y, _, _ = gemm_fwd(x_chunk, w_chunk, None, config=config, out_dtype=torch.float32)
    return y


def ksplit_linear(x: torch.Tensor, weight: torch.Tensor | Sequence[torch.Tensor], bias: torch.Tensor | None = None,
                  *, t: int, engine: str | None = None, stream: str = "image", config=None) -> torch.Tensor:
    """``y = cast(tree_j(X[:, K_j] W[:, K_j]ᵀ) + b)`` with K cut into ``t`` equal contiguous chunks.

    Args:
        x: (M, K), FP32 or BF16 (``"cpu"``: FP32), contiguous rows (unit column stride).
        weight: (N, K) as nn.Linear stores it, or the ``t`` contiguous (N, K/t) blocks
            :func:`split_weight` makes (pass those to avoid a copy per call).
        bias: (N,) or None; added once, in FP32, after the tree.
        t: chunk count; must divide K (``"triton"``: K/t a multiple of the configuration's BLOCK_K).
        engine: ``"triton"`` or ``"cpu"`` (default: :func:`default_engine`).
        stream: the GEMM stream whose configuration the layer runs (``"image"`` or ``"text"``; Triton only).
        config: an explicit Triton configuration (default :func:`layer_config` of (N, K, dtype, stream)).
    Returns:
        (M, N) in x's dtype. Rows are batch-invariant: each depends only on its own row of x.
    """
    engine = engine or default_engine(x)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"K-split: expected x of shape (M, K), got {getattr(x, 'shape', type(x).__name__)}")
    k = x.shape[1]
    if isinstance(weight, torch.Tensor):
        if weight.dim() != 2 or weight.shape[1] != k:
            raise ValueError(f"K-split: expected weight of shape (N, {k}), got {tuple(weight.shape)}")
        n = weight.shape[0]
    else:
        n = weight[0].shape[0] if len(weight) and weight[0].dim() == 2 else -1
    step = 1
    if engine == "triton":
        config = config or layer_config(n, k, x.dtype, stream)
        step = config.BLOCK_K
    bounds = chunk_bounds(k, t, step)
    chunks = split_weight(weight, t) if isinstance(weight, torch.Tensor) else list(weight)
    if len(chunks) != t:
        raise ValueError(f"K-split: expected {t} weight chunks, got {len(chunks)}")
    _check(x, chunks, bias, engine)
    if x.stride(1) != 1:
        x = x.contiguous()
    partials = [chunk_product(x[:, a:b], c, engine=engine, config=config) for (a, b), c in zip(bounds, chunks)]
    s = tree_sum(partials)
    if bias is not None:
        s = s + bias.to(torch.float32)
    return s.to(x.dtype)
