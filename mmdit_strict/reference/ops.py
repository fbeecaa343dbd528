"""Independent FP64 CPU references of the model operators (docs/design.md §5), in the packed layout.

Every function here is written from the math in ``docs/operators.md`` and docs/design.md §2, for clarity and
not for speed: inputs are cast to ``torch.float64`` (on the CPU) at entry and the result is FP64. Nothing
here imports the kernels or the model, so a bug cannot hide in both (docs/design.md §3, last paragraph).

Packed layout: a stream's valid rows of all samples are concatenated, ``x: (M, C)`` with
``M = sum(seqlens)``; per-sample vectors (shift, scale, gate, temb) are ``(B, C)`` with ``B = len(seqlens)``.
Row ``r`` belongs to sample ``s`` where ``sum(seqlens[:s]) <= r < sum(seqlens[:s + 1])``.

Some functions accept keyword arguments they do not need (``seqlens`` of row-wise operators, ``dtype`` of
the timestep MLP) so that a test can call the reference with the kernel's exact arguments; they are
validated and otherwise unused. Backward references come from :func:`reference_grads` (torch autograd on
these FP64 forwards), which is an honest check for a reference: FP64 autograd of straightforward math.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

F64 = torch.float64

_PROLOGUES = ("none", "silu")
_EPILOGUES = ("none", "gelu_tanh", "silu")

LoRA = tuple[torch.Tensor, torch.Tensor, float]


# ----------------------------------------------------------------------------------------------- helpers


def _f64(t: torch.Tensor) -> torch.Tensor:
    """The same values as a CPU FP64 tensor (autograd still flows through the cast)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    return t.to(device="cpu", dtype=F64)


def _check_seqlens(seqlens: Sequence[int] | None, rows: int, what: str = "x") -> tuple[int, ...] | None:
    if seqlens is None:
        return None
    lens = tuple(int(n) for n in seqlens)
    if any(n < 0 for n in lens):
        raise ValueError(f"seqlens must be non-negative, got {lens}")
    if sum(lens) != rows:
        raise ValueError(f"seqlens {lens} sum to {sum(lens)} but {what} has {rows} rows")
    return lens


def row_sample_index(seqlens: Sequence[int]) -> torch.Tensor:
    """``(M,)`` int64: the sample each packed row belongs to."""
    lens = tuple(int(n) for n in seqlens)
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.long))


def _per_sample_rows(v: torch.Tensor, seqlens: Sequence[int] | None, name: str) -> torch.Tensor:
    """Expand a per-sample ``(B, C)`` vector to one copy per packed row, ``(M, C)``."""
    if seqlens is None:
        raise ValueError(f"seqlens is required to expand the per-sample {name} to packed rows")
    if v.dim() != 2 or v.shape[0] != len(seqlens):
        raise ValueError(f"expected {name} of shape (B={len(seqlens)}, C), got {tuple(v.shape)}")
    return v[row_sample_index(seqlens)]


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x · sigmoid(x) = x / (1 + exp(-x))`` in FP64."""
    x = _f64(x)
    return x / (1.0 + torch.exp(-x))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximate GELU: ``0.5 x (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))`` in FP64."""
    x = _f64(x)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


# ---------------------------------------------------------------------------------------------- GEMM family


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    prologue: str = "none",
    epilogue: str = "none",
    lora: LoRA | None = None,
    *,
    seqlens: Sequence[int] | None = None,
) -> torch.Tensor:
    """``epilogue(p(x) Wᵀ + b + scale · (p(x) Aᵀ) Bᵀ)`` — the GEMM family of docs/operators.md.

    Args:
        x: ``(M, K)``.
        w: ``(N, K)`` (nn.Linear layout).
        b: ``(N,)`` or None.
        prologue: ``"none"`` or ``"silu"`` (applied to ``x`` first; ``adaln_mod_projection`` uses it).
        epilogue: ``"none"``, ``"gelu_tanh"`` or ``"silu"`` (applied after bias and LoRA).
        lora: None or ``(A (r, K), B (N, r), scale)`` in PEFT layout, never merged into ``w``.
        seqlens: accepted for signature parity with the kernels; only checked against ``M``.

    Returns:
        ``(M, N)`` FP64.
    """
    if prologue not in _PROLOGUES:
        raise ValueError(f"prologue must be one of {_PROLOGUES}, got {prologue!r}")
    if epilogue not in _EPILOGUES:
        raise ValueError(f"epilogue must be one of {_EPILOGUES}, got {epilogue!r}")
    x, w = _f64(x), _f64(w)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x (M, K) and weight (N, K), got {tuple(x.shape)} and {tuple(w.shape)}")
    _check_seqlens(seqlens, x.shape[0])
    n, k = w.shape
    if prologue == "silu":
        x = silu(x)
    y = x @ w.T
    if b is not None:
        b = _f64(b)
        if b.shape != (n,):
            raise ValueError(f"expected bias of shape ({n},), got {tuple(b.shape)}")
        y = y + b
    if lora is not None:
        a_mat, b_mat, scale = lora
        a_mat, b_mat = _f64(a_mat), _f64(b_mat)
        r = a_mat.shape[0]
        if a_mat.shape != (r, k) or b_mat.shape != (n, r):
            raise ValueError(
                f"expected LoRA A (r, {k}) and B ({n}, r), got {tuple(a_mat.shape)} and {tuple(b_mat.shape)}"
            )
        y = y + float(scale) * ((x @ a_mat.T) @ b_mat.T)
    if epilogue == "gelu_tanh":
        y = gelu_tanh(y)
    elif epilogue == "silu":
        y = silu(y)
    return y


# ------------------------------------------------------------------------------------------------ norms


def rmsnorm(x: torch.Tensor, gain: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x², last dim) + eps) · gain`` over the last dimension (gain may be None)."""
    x = _f64(x)
    y = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    if gain is not None:
        gain = _f64(gain)
        if gain.shape != (x.shape[-1],):
            raise ValueError(f"expected gain of shape ({x.shape[-1]},), got {tuple(gain.shape)}")
        y = y * gain
    return y


def layernorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Parameter-free LayerNorm over the last dimension: ``(x − mean) / sqrt(biased var + eps)``."""
    x = _f64(x)
    mean = x.mean(dim=-1, keepdim=True)
    centred = x - mean
    var = (centred * centred).mean(dim=-1, keepdim=True)
    return centred / torch.sqrt(var + eps)


def qk_rmsnorm(
    x: torch.Tensor, gain: torch.Tensor, eps: float, *, seqlens: Sequence[int] | None = None
) -> torch.Tensor:
    """Per-head RMSNorm with learned gain: ``x (M, H, d)``, ``gain (d,)`` → ``(M, H, d)``."""
    x = _f64(x)
    if x.dim() != 3:
        raise ValueError(f"expected x of shape (M, H, d), got {tuple(x.shape)}")
    _check_seqlens(seqlens, x.shape[0])
    return rmsnorm(x, gain, eps)


def txt_in_rmsnorm_linear(
    x: torch.Tensor,
    gain: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    eps: float,
    seqlens: Sequence[int] | None = None,
    lora: LoRA | None = None,
) -> torch.Tensor:
    """Text input: ``RMSNorm(x)·gain`` then ``Linear``. ``x (M, Ct)`` → ``(M, N)``."""
    x = _f64(x)
    if x.dim() != 2:
        raise ValueError(f"expected x of shape (M, Ct), got {tuple(x.shape)}")
    _check_seqlens(seqlens, x.shape[0])
    return linear(rmsnorm(x, gain, eps), weight, bias, lora=lora)


# ---------------------------------------------------------------------------------------- modulation


def adaln_modulation(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, seqlens: Sequence[int], eps: float
) -> torch.Tensor:
    """``LayerNorm(x)·(1 + scale[s]) + shift[s]``: ``x (M, D)``, ``shift, scale (B, D)`` → ``(M, D)``."""
    x = _f64(x)
    if x.dim() != 2:
        raise ValueError(f"expected x of shape (M, D), got {tuple(x.shape)}")
    lens = _check_seqlens(seqlens, x.shape[0])
    shift_rows = _per_sample_rows(_f64(shift), lens, "shift")
    scale_rows = _per_sample_rows(_f64(scale), lens, "scale")
    return layernorm(x, eps) * (1.0 + scale_rows) + shift_rows


def adaln_gate_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor:
    """Gated residual ``x + gate[s]·y``: ``x, y (M, D)``, ``gate (B, D)`` → ``(M, D)``."""
    x, y = _f64(x), _f64(y)
    if x.shape != y.shape or x.dim() != 2:
        raise ValueError(f"expected x and y of the same shape (M, D), got {tuple(x.shape)} and {tuple(y.shape)}")
    lens = _check_seqlens(seqlens, x.shape[0])
    return x + _per_sample_rows(_f64(gate), lens, "gate") * y


def final_adaln_out(
    x: torch.Tensor,
    temb: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    seqlens: Sequence[int],
    eps: float,
    *,
    lora: LoRA | None = None,
) -> torch.Tensor:
    """Final image-stream modulation: ``scale, shift = SiLU(temb) Wᵀ + b`` (that order), then
    ``LayerNorm(x)·(1 + scale[s]) + shift[s]``. ``x (M, D)``, ``temb (B, D)``, ``w (2D, D)`` → ``(M, D)``."""
    x = _f64(x)
    d = x.shape[-1]
    emb = linear(temb, w, b, prologue="silu", lora=lora)  # (B, 2D)
    if emb.shape[1] != 2 * d:
        raise ValueError(f"expected weight of shape ({2 * d}, {d}), got {tuple(_f64(w).shape)}")
    scale, shift = emb[:, :d], emb[:, d:]
    return adaln_modulation(x, shift, scale, seqlens, eps)


# --------------------------------------------------------------------------------------------- timestep


def timestep_embedding(sigma: torch.Tensor, channels: int = 256, scale: float = 1000.0,
                       max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of ``scale·sigma``, cos half first: ``(B,)`` → ``(B, channels)``.

    ``freq_i = max_period^(−i / (channels/2))`` for ``i = 0 … channels/2 − 1``; the output is
    ``[cos(scale·σ·freq), sin(scale·σ·freq)]`` (diffusers' ``Timesteps(flip_sin_to_cos=True,
    downscale_freq_shift=0)``), computed in FP64.
    """
    sigma = _f64(sigma)
    if sigma.dim() != 1:
        raise ValueError(f"expected sigma of shape (B,), got {tuple(sigma.shape)}")
    if channels % 2:
        raise ValueError(f"channels must be even, got {channels}")
    half = channels // 2
    i = torch.arange(half, dtype=F64)
    freqs = torch.exp(-math.log(max_period) * i / half)
    angle = (float(scale) * sigma)[:, None] * freqs[None, :]
    return torch.cat([torch.cos(angle), torch.sin(angle)], dim=1)


def timestep_embed_mlp(
    sigma: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    *,
    channels: int = 256,
    scale: float = 1000.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``Linear2(SiLU(Linear1(timestep_embedding(sigma))))``: ``(B,)`` → ``(B, D)``.

    ``dtype`` is accepted for signature parity with the kernel; the reference always returns FP64.
    """
    del dtype
    emb = timestep_embedding(sigma, channels, scale)
    return linear(linear(emb, w1, b1, epilogue="silu"), w2, b2)


# ---------------------------------------------------------------------------------------- RoPE, attention


def multi_axis_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` by angle ``θ_i``: the complex product
    ``(x[2i] + i·x[2i+1]) · (cos θ_i + i·sin θ_i)``. ``x (M, H, d)``, ``cos, sin (M, d/2)`` → ``(M, H, d)``."""
    x, cos, sin = _f64(x), _f64(cos), _f64(sin)
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"expected x of shape (M, H, d) with even d, got {tuple(x.shape)}")
    m, h, d = x.shape
    if cos.shape != (m, d // 2) or sin.shape != (m, d // 2):
        raise ValueError(
            f"expected cos and sin of shape ({m}, {d // 2}), got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    re, im = x[..., 0::2], x[..., 1::2]  # (M, H, d/2)
    c, s = cos[:, None, :], sin[:, None, :]
    out_re = re * c - im * s
    out_im = re * s + im * c
    return torch.stack([out_re, out_im], dim=-1).reshape(m, h, d)


def joint_attention(
    q_txt: torch.Tensor,
    k_txt: torch.Tensor,
    v_txt: torch.Tensor,
    q_img: torch.Tensor,
    k_img: torch.Tensor,
    v_img: torch.Tensor,
    txt_seqlens: Sequence[int],
    img_seqlens: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint non-causal attention, per sample over its own ``[text, image]`` tokens.

    For sample ``s`` with text rows ``T_s`` and image rows ``I_s``: ``Q = [q_txt[T_s]; q_img[I_s]]`` (same for
    K, V), and per head ``O = softmax(Q Kᵀ / sqrt(d)) V`` (max-subtracted, exact exp, FP64).

    Args:
        q_txt, k_txt, v_txt: ``(Mt, H, d)`` packed text rows.
        q_img, k_img, v_img: ``(Mi, H, d)`` packed image rows.
        txt_seqlens, img_seqlens: rows per sample of each stream (same number of samples).

    Returns:
        ``(out_txt (Mt, H·d), out_img (Mi, H·d))`` FP64.
    """
    q_txt, k_txt, v_txt = _f64(q_txt), _f64(k_txt), _f64(v_txt)
    q_img, k_img, v_img = _f64(q_img), _f64(k_img), _f64(v_img)
    for name, t in (("q_txt", q_txt), ("k_txt", k_txt), ("v_txt", v_txt),
                    ("q_img", q_img), ("k_img", k_img), ("v_img", v_img)):
        if t.dim() != 3 or t.shape[1:] != q_img.shape[1:]:
            raise ValueError(
                f"expected {name} of shape (rows, H, d) with (H, d) = {tuple(q_img.shape[1:])}, got {tuple(t.shape)}"
            )
    if not (q_txt.shape == k_txt.shape == v_txt.shape) or not (q_img.shape == k_img.shape == v_img.shape):
        raise ValueError("q, k and v of one stream must have the same shape")
    t_lens = _check_seqlens(txt_seqlens, q_txt.shape[0], "q_txt")
    i_lens = _check_seqlens(img_seqlens, q_img.shape[0], "q_img")
    if len(t_lens) != len(i_lens):
        raise ValueError(f"txt_seqlens {t_lens} and img_seqlens {i_lens} must have one entry per sample each")
    _, h, d = q_img.shape
    out_txt, out_img = [], []
    t0 = i0 = 0
    for lt, li in zip(t_lens, i_lens):
        q = torch.cat([q_txt[t0:t0 + lt], q_img[i0:i0 + li]])  # (L, H, d)
        k = torch.cat([k_txt[t0:t0 + lt], k_img[i0:i0 + li]])
        v = torch.cat([v_txt[t0:t0 + lt], v_img[i0:i0 + li]])
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)  # (H, L, L)
        p = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
        p = p / p.sum(dim=-1, keepdim=True)
        o = torch.einsum("hqk,khd->qhd", p, v).reshape(lt + li, h * d)
        out_txt.append(o[:lt])
        out_img.append(o[lt:])
        t0 += lt
        i0 += li
    empty = q_img.new_zeros((0, h * d))
    return (torch.cat(out_txt) if out_txt else empty, torch.cat(out_img) if out_img else empty)


# -------------------------------------------------------------------------------------------------- latents


def _channel_stats(z: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``z`` in FP64 and ``mean``/``std`` shaped to broadcast over dim 1 of ``z (B, C, ...)``."""
    z = _f64(z)
    mean_t = torch.tensor(list(mean), dtype=F64)
    std_t = torch.tensor(list(std), dtype=F64)
    if z.dim() < 2 or z.shape[1] != mean_t.numel() or std_t.numel() != mean_t.numel():
        raise ValueError(
            f"expected z (B, {mean_t.numel()}, ...) and {mean_t.numel()} mean/std values, got {tuple(z.shape)}"
        )
    view = (1, -1) + (1,) * (z.dim() - 2)
    return z, mean_t.view(view), std_t.view(view)


def latent_normalize(z: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``(z − mean[c]) / std[c]`` per latent channel; ``z (B, C, ...)`` with channels on dim 1."""
    z, m, s = _channel_stats(z, mean, std)
    return (z - m) / s


def latent_denormalize(z: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Inverse of :func:`latent_normalize`: ``z·std[c] + mean[c]``."""
    z, m, s = _channel_stats(z, mean, std)
    return z * s + m


def latent_pack(z: torch.Tensor, patch_size: int = 2) -> torch.Tensor:
    """Pack ``z (B, C, H, W)`` (or ``(B, C, 1, H, W)``) into tokens ``(B, (H/p)(W/p), C·p²)``.

    Token ``i·(W/p) + j`` holds, at value index ``c·p² + dy·p + dx``, the latent ``z[b, c, i·p + dy, j·p + dx]``.
    """
    z = _f64(z)
    if z.dim() == 5:
        if z.shape[2] != 1:
            raise ValueError(f"expected a single frame (B, C, 1, H, W), got {tuple(z.shape)}")
        z = z[:, :, 0]
    if z.dim() != 4:
        raise ValueError(f"expected z of shape (B, C, H, W), got {tuple(z.shape)}")
    bsz, c, hgt, wid = z.shape
    p = patch_size
    if hgt % p or wid % p:
        raise ValueError(f"latent height and width must be multiples of {p}, got {hgt}×{wid}")
    gh, gw = hgt // p, wid // p
    out = z.new_empty((bsz, gh, gw, c, p, p))
    for dy in range(p):
        for dx in range(p):
            # z[b, c, i*p + dy, j*p + dx] for all (i, j) → (B, C, gh, gw) → (B, gh, gw, C)
            out[:, :, :, :, dy, dx] = z[:, :, dy::p, dx::p].permute(0, 2, 3, 1)
    return out.reshape(bsz, gh * gw, c * p * p)


def latent_unpack(tokens: torch.Tensor, height: int, width: int, patch_size: int = 2) -> torch.Tensor:
    """Inverse of :func:`latent_pack`: ``(B, (H/p)(W/p), C·p²)`` → ``(B, C, 1, H, W)`` (the pipeline's layout)."""
    tokens = _f64(tokens)
    p = patch_size
    if tokens.dim() != 3 or height % p or width % p or tokens.shape[1] != (height // p) * (width // p) \
            or tokens.shape[2] % (p * p):
        raise ValueError(f"tokens of shape {tuple(tokens.shape)} do not pack a {height}×{width} latent with patch {p}")
    bsz, _, cpp = tokens.shape
    c, gh, gw = cpp // (p * p), height // p, width // p
    grid = tokens.reshape(bsz, gh, gw, c, p, p)
    z = tokens.new_empty((bsz, c, height, width))
    for dy in range(p):
        for dx in range(p):
            z[:, :, dy::p, dx::p] = grid[:, :, :, :, dy, dx].permute(0, 3, 1, 2)
    return z[:, :, None]


# ------------------------------------------------------------------------------------------------ backward


def reference_grads(
    fn: Callable[..., torch.Tensor | Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor | None],
    grad_out: torch.Tensor | Sequence[torch.Tensor],
    **kwargs,
) -> tuple[torch.Tensor | None, ...]:
    """FP64 gradients of ``fn(*inputs, **kwargs)`` with respect to every floating tensor input.

    Each floating tensor input is copied to a fresh FP64 leaf; ``grad_out`` (one tensor, or one per output
    when ``fn`` returns a tuple) is cast to FP64. Returns one entry per input: the gradient (zeros where the
    output does not depend on it) or None for non-tensor / non-floating inputs. Wrap structured arguments
    (LoRA tuples) in a lambda: ``reference_grads(lambda x, w, a, b: linear(x, w, lora=(a, b, 0.5)), ...)``.
    """
    leaves: list[torch.Tensor | None] = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            leaves.append(_f64(t).detach().clone().requires_grad_(True))
        else:
            leaves.append(t)
    with torch.enable_grad():
        out = fn(*leaves, **kwargs)
    outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
    gouts = (grad_out,) if isinstance(grad_out, torch.Tensor) else tuple(grad_out)
    if len(outs) != len(gouts):
        raise ValueError(f"fn returned {len(outs)} outputs but {len(gouts)} grad_out tensors were given")
    gouts = tuple(_f64(g) for g in gouts)
    for o, g in zip(outs, gouts):
        if o.shape != g.shape:
            raise ValueError(f"grad_out of shape {tuple(g.shape)} does not match output of shape {tuple(o.shape)}")
    wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = iter(torch.autograd.grad(outs, wrt, gouts, allow_unused=True, materialize_grads=True))
    return tuple(next(grads) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves)


__all__ = [
    "adaln_gate_residual",
    "adaln_modulation",
    "final_adaln_out",
    "gelu_tanh",
    "joint_attention",
    "latent_denormalize",
    "latent_normalize",
    "latent_pack",
    "latent_unpack",
    "layernorm",
    "linear",
    "multi_axis_rope",
    "qk_rmsnorm",
    "reference_grads",
    "rmsnorm",
    "row_sample_index",
    "silu",
    "timestep_embed_mlp",
    "timestep_embedding",
    "txt_in_rmsnorm_linear",
]
