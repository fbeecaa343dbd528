"""The FP64 reference against diffusers, the parity peer (docs/design.md §2).

diffusers' ``QwenImageTransformer2DModel`` cast to float64 still computes four things in FP32: the
timestep sinusoid (``timesteps.float()``), the RoPE tables (built in float32 / complex64), the RoPE
product (``x.float()``) and the RMSNorm variance (``.to(torch.float32)``). To check the reference at
FP64 precision, ``_PromoteToFP64`` runs diffusers' own code with every float32 / complex64 request
turned into float64 / complex128 — nothing of diffusers is re-implemented here. The model as shipped
(FP32 islands) and in FP32 are compared too, under their own declared tolerances.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mmdit_strict.config.arch import ArchConfig
from mmdit_strict.reference import ops as ref
from mmdit_strict.reference.model import reference_forward
from mmdit_strict.reference.rope import image_positions, rope_tables, text_positions
from mmdit_strict.tolerances import tolerance

diffusers = pytest.importorskip("diffusers")
from diffusers import QwenImageTransformer2DModel  # noqa: E402
from diffusers.models.embeddings import get_timestep_embedding  # noqa: E402
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope  # noqa: E402

TINY = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=2,
    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=(4, 6, 6),
)
ARCH = ArchConfig(**TINY)
# Scaled-down versions of the three reference grids (64×64, 83×83, 104×58 tokens), plus a wide one.
GRIDS = [(8, 8), (9, 9), (13, 7), (4, 6)]
FULL_GRIDS = [(64, 64), (83, 83), (104, 58)]


class _PromoteToFP64(TorchFunctionMode):
    """Run torch code with float32 → float64 and complex64 → complex128 wherever it asks for them."""

    _MAP = {torch.float32: torch.float64, torch.complex64: torch.complex128}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        args = tuple(self._MAP.get(a, a) if isinstance(a, torch.dtype) else a for a in args)
        kwargs = {k: (self._MAP.get(v, v) if isinstance(v, torch.dtype) else v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def _check(check: str, dtype: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = tolerance("reference", check, dtype)
    passed, max_abs, max_rel = tol.check(actual, expected)
    assert passed, f"reference.{check}.{dtype}: max_abs {max_abs:.3e}, max_rel {max_rel:.3e} ({tol.reason})"


def _randomize(model: torch.nn.Module, seed: int = 1) -> None:
    """Every parameter ~ N(0, 0.1²); norm gains ~ N(1, 0.1²), so nothing is trivially 0 or 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_gain = "norm" in name and name.endswith(".weight") and p.dim() == 1
            p.copy_((1.0 if is_gain else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))


def _build(promoted: bool, dtype: torch.dtype) -> QwenImageTransformer2DModel:
    torch.manual_seed(0)
    if promoted:
        with _PromoteToFP64():  # RoPE tables are built in __init__
            model = QwenImageTransformer2DModel(**TINY)
    else:
        model = QwenImageTransformer2DModel(**TINY)
    _randomize(model)
    return model.to(dtype).eval()


@pytest.fixture(scope="module")
def models() -> dict[str, QwenImageTransformer2DModel]:
    return {
        "promoted": _build(True, torch.float64),
        "shipped": _build(False, torch.float64),
        "fp32": _build(False, torch.float32),
    }


def _inputs(batch: int, grid: tuple[int, int], txt_len: int, valid: list[int] | None, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    h, w = grid
    x = torch.randn(batch, h * w, 64, generator=gen, dtype=torch.float64)
    e = torch.randn(batch, txt_len, 48, generator=gen, dtype=torch.float64)
    sigma = torch.rand(batch, generator=gen, dtype=torch.float64)
    mask = None
    if valid is not None:
        mask = (torch.arange(txt_len)[None, :] < torch.tensor(valid)[:, None]).to(torch.long)
    return x, e, mask, sigma


def _diffusers_forward(model, x, e, mask, sigma, grid, promoted: bool, dtype=torch.float64, hooks_out=None):
    shapes = [[(1, *grid)]] * x.shape[0]
    handles = []
    if hooks_out is not None:
        for i, block in enumerate(model.transformer_blocks):
            def hook(_mod, _inp, out, i=i):
                hooks_out[f"block{i}.txt"], hooks_out[f"block{i}.img"] = out
            handles.append(block.register_forward_hook(hook))
    try:
        with torch.no_grad():
            if promoted:
                with _PromoteToFP64():
                    return model(x, e, mask, sigma, shapes).sample
            return model(x.to(dtype), e.to(dtype), mask, sigma.to(dtype), shapes).sample
    finally:
        for h in handles:
            h.remove()


CASES = [
    pytest.param(1, (8, 8), 7, None, id="B1-8x8-nomask"),
    pytest.param(1, (4, 6), 5, [5], id="B1-4x6-fullmask"),
    pytest.param(3, (4, 6), 9, [9, 3, 6], id="B3-4x6-padded"),
    pytest.param(2, (9, 9), 6, [2, 6], id="B2-9x9-padded"),
    pytest.param(2, (13, 7), 8, [8, 1], id="B2-13x7-padded"),
    pytest.param(2, (4, 6), 4, [0, 4], id="B2-4x6-empty-prompt"),
]


@pytest.mark.parametrize("batch, grid, txt_len, valid", CASES)
def test_model_matches_promoted_diffusers(models, batch, grid, txt_len, valid):
    x, e, mask, sigma = _inputs(batch, grid, txt_len, valid)
    blocks: dict[str, torch.Tensor] = {}
    expected = _diffusers_forward(models["promoted"], x, e, mask, sigma, grid, promoted=True, hooks_out=blocks)
    capture: dict[str, torch.Tensor] = {}
    actual = reference_forward(models["promoted"].state_dict(), ARCH, x, e, mask, sigma, [(1, *grid)] * batch,
                               capture=capture)
    assert actual.dtype == torch.float64 and actual.shape == (batch, grid[0] * grid[1], 64)
    _check("model_vs_diffusers", "fp64", actual, expected)
    # Per-block captures are the packed valid rows of diffusers' block outputs.
    lens = [txt_len] * batch if valid is None else valid
    for i in range(ARCH.num_layers):
        img_rows = blocks[f"block{i}.img"].reshape(-1, ARCH.hidden_size)
        _check("model_vs_diffusers", "fp64", capture[f"block{i}.img"], img_rows)
        txt_rows = torch.cat([blocks[f"block{i}.txt"][b, :n] for b, n in enumerate(lens)])
        _check("model_vs_diffusers", "fp64", capture[f"block{i}.txt"], txt_rows)


@pytest.mark.parametrize("batch, grid, txt_len, valid", [CASES[2], CASES[4]])
def test_model_matches_diffusers_as_shipped(models, batch, grid, txt_len, valid):
    x, e, mask, sigma = _inputs(batch, grid, txt_len, valid)
    sd = models["shipped"].state_dict()
    actual = reference_forward(sd, ARCH, x, e, mask, sigma, [(1, *grid)] * batch)
    expected64 = _diffusers_forward(models["shipped"], x, e, mask, sigma, grid, promoted=False)
    _check("model_vs_diffusers_fp64_as_shipped", "fp64", actual, expected64)
    expected32 = _diffusers_forward(models["fp32"], x, e, mask, sigma, grid, promoted=False, dtype=torch.float32)
    _check("model_vs_diffusers", "fp32", actual, expected32)


def test_sample_result_ignores_batch_and_padding(models):
    """The reference is per sample by construction: padding a prompt or batching changes nothing."""
    x, e, mask, sigma = _inputs(3, (4, 6), 9, [9, 3, 6])
    sd = models["promoted"].state_dict()
    batched = reference_forward(sd, ARCH, x, e, mask, sigma, [(1, 4, 6)] * 3)
    alone = reference_forward(sd, ARCH, x[1:2], e[1:2, :3], None, sigma[1:2], [(1, 4, 6)])
    assert torch.equal(batched[1:2], alone)


def test_model_rejects_bad_inputs(models):
    x, e, mask, sigma = _inputs(2, (4, 6), 5, [5, 3])
    sd = models["promoted"].state_dict()
    holes = mask.clone()
    holes[1] = torch.tensor([1, 0, 1, 0, 0])
    with pytest.raises(ValueError, match="prefix mask"):
        reference_forward(sd, ARCH, x, e, holes, sigma, [(1, 4, 6)] * 2)
    with pytest.raises(ValueError, match="img_shapes"):
        reference_forward(sd, ARCH, x, e, mask, sigma, [(1, 4, 5)] * 2)
    with pytest.raises(ValueError, match="one per sample"):
        reference_forward(sd, ARCH, x, e, mask, sigma, [(1, 4, 6)])
    with pytest.raises(KeyError, match="proj_out.weight"):
        reference_forward({k: v for k, v in sd.items() if k != "proj_out.weight"}, ARCH, x, e, mask, sigma,
                          [(1, 4, 6)] * 2)


# ---------------------------------------------------------------------------------------------- RoPE


def test_positions_are_centred_and_text_on_the_diagonal():
    pos = image_positions((1, 5, 4)).reshape(5, 4, 3)
    assert pos[:, 0, 1].tolist() == [-3, -2, -1, 0, 1]
    assert pos[0, :, 2].tolist() == [-2, -1, 0, 1]
    assert pos[..., 0].unique().tolist() == [0]
    assert text_positions((1, 5, 4), 3).tolist() == [[2, 2, 2], [3, 3, 3], [4, 4, 4]]


def _check_tables(dtype: str, ours, img_freqs: torch.Tensor, txt_freqs: torch.Tensor) -> None:
    """Our (img_cos, img_sin, txt_cos, txt_sin) against diffusers' complex (img, txt) tables."""
    theirs = (img_freqs.real, img_freqs.imag, txt_freqs.real, txt_freqs.imag)
    for actual, expected in zip(ours, theirs):
        _check("rope_tables_vs_diffusers", dtype, actual, expected)


@pytest.mark.parametrize("grid", GRIDS + FULL_GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("axes", [(4, 6, 6), (16, 56, 56)], ids=["tiny", "qwen"])
def test_rope_tables_match_diffusers(grid, axes):
    txt_len = 11
    (img_cos, img_sin, txt_cos, txt_sin), = rope_tables([(1, *grid)], [txt_len], axes, 10000)
    with _PromoteToFP64():
        rope64 = QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)
        img64, txt64 = rope64([[(1, *grid)]], device=torch.device("cpu"), max_txt_seq_len=txt_len)
    assert img64.dtype == torch.complex128
    _check_tables("fp64", (img_cos, img_sin, txt_cos, txt_sin), img64, txt64)
    rope32 = QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)
    img32, txt32 = rope32([[(1, *grid)]], device=torch.device("cpu"), max_txt_seq_len=txt_len)
    _check_tables("fp32", (img_cos, img_sin, txt_cos, txt_sin), img32, txt32)


def test_multi_axis_rope_is_the_complex_product():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(10, 3, 8, generator=gen, dtype=torch.float64)
    angle = torch.randn(10, 4, generator=gen, dtype=torch.float64) * 5
    out = ref.multi_axis_rope(x, torch.cos(angle), torch.sin(angle))
    rotation = torch.polar(torch.ones_like(angle), angle)[:, None]  # (10, 1, 4) complex
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(10, 3, 4, 2)) * rotation)
    _check("ops_vs_torch", "fp64", out, expected.reshape(10, 3, 8))


# ------------------------------------------------------------------------------------------- timestep


def test_timestep_embedding_matches_diffusers():
    sigma = torch.tensor([0.0, 1e-3, 0.25, 0.5, 0.7731, 0.999, 1.0], dtype=torch.float64)
    actual = ref.timestep_embedding(sigma, 256, 1000.0)
    args = dict(embedding_dim=256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000)
    with _PromoteToFP64():
        expected64 = get_timestep_embedding(sigma, **args)
    assert expected64.dtype == torch.float64
    _check("timestep_embedding_vs_diffusers", "fp64", actual, expected64)
    _check("timestep_embedding_vs_diffusers", "fp32", actual, get_timestep_embedding(sigma.float(), **args))


def test_timestep_embed_mlp_matches_diffusers(models):
    model = models["promoted"]
    sigma = torch.tensor([0.1, 0.6, 1.0], dtype=torch.float64)
    p = "time_text_embed.timestep_embedder"
    sd = model.state_dict()
    actual = ref.timestep_embed_mlp(sigma, sd[f"{p}.linear_1.weight"], sd[f"{p}.linear_1.bias"],
                                    sd[f"{p}.linear_2.weight"], sd[f"{p}.linear_2.bias"], channels=256, scale=1000.0)
    with torch.no_grad(), _PromoteToFP64():
        expected = model.time_text_embed(sigma, sigma.new_zeros(3, 1))
    _check("model_vs_diffusers", "fp64", actual, expected)


# ------------------------------------------------------------------------------------ elementwise ops


def test_row_ops_match_torch():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 32, generator=gen, dtype=torch.float64) * 3
    gain = 1 + 0.1 * torch.randn(32, generator=gen, dtype=torch.float64)
    _check("ops_vs_torch", "fp64", ref.gelu_tanh(x), torch.nn.functional.gelu(x, approximate="tanh"))
    _check("ops_vs_torch", "fp64", ref.silu(x), torch.nn.functional.silu(x))
    _check("ops_vs_torch", "fp64", ref.layernorm(x, 1e-6), torch.nn.functional.layer_norm(x, (32,), eps=1e-6))
    _check("ops_vs_torch", "fp64", ref.rmsnorm(x, gain, 1e-6), torch.nn.functional.rms_norm(x, (32,), gain, eps=1e-6))
    xh = x.reshape(7, 4, 8)
    _check("ops_vs_torch", "fp64", ref.qk_rmsnorm(xh, gain[:8], 1e-6, seqlens=(3, 4)),
           torch.nn.functional.rms_norm(xh, (8,), gain[:8], eps=1e-6))


def test_linear_with_lora_and_epilogues():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    w = torch.randn(12, 10, generator=gen, dtype=torch.float64)
    b = torch.randn(12, generator=gen, dtype=torch.float64)
    a_mat = torch.randn(3, 10, generator=gen, dtype=torch.float64)
    b_mat = torch.randn(12, 3, generator=gen, dtype=torch.float64)
    silu_x = torch.nn.functional.silu(x)
    pre = silu_x @ w.T + b + 0.5 * (silu_x @ a_mat.T) @ b_mat.T
    out = ref.linear(x, w, b, prologue="silu", epilogue="gelu_tanh", lora=(a_mat, b_mat, 0.5))
    _check("ops_vs_torch", "fp64", out, torch.nn.functional.gelu(pre, approximate="tanh"))
    with pytest.raises(ValueError, match="epilogue"):
        ref.linear(x, w, b, epilogue="gelu")


def test_modulation_and_gate_follow_their_sample():
    gen = torch.Generator().manual_seed(6)
    seqlens = (2, 0, 3)
    x = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    shift, scale, gate = (torch.randn(3, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    rows = torch.tensor([0, 0, 2, 2, 2])
    ln = torch.nn.functional.layer_norm(x, (8,), eps=1e-6)
    _check("ops_vs_torch", "fp64", ref.adaln_modulation(x, shift, scale, seqlens, 1e-6),
           ln * (1 + scale[rows]) + shift[rows])
    _check("ops_vs_torch", "fp64", ref.adaln_gate_residual(x, y, gate, seqlens), x + gate[rows] * y)
    w = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    emb = torch.nn.functional.silu(shift) @ w.T
    _check("ops_vs_torch", "fp64", ref.final_adaln_out(x, shift, w, None, seqlens, 1e-6),
           ln * (1 + emb[rows, :8]) + emb[rows, 8:])
    with pytest.raises(ValueError, match="sum to"):
        ref.adaln_gate_residual(x, y, gate, (2, 2))


def test_joint_attention_matches_masked_sdpa():
    gen = torch.Generator().manual_seed(7)
    heads, d, txt_lens, img_len = 2, 8, (4, 1), 6
    qkv = [torch.randn(2, heads, max(txt_lens) + img_len, d, generator=gen, dtype=torch.float64) for _ in range(3)]
    keep = torch.ones(2, max(txt_lens) + img_len, dtype=torch.bool)
    keep[1, 1:max(txt_lens)] = False
    expected = torch.nn.functional.scaled_dot_product_attention(*qkv, attn_mask=keep[:, None, None, :])

    def pack(t, stream):  # (B, H, L, d) → packed valid rows (M, H, d) of one stream
        if stream == "txt":
            return torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(txt_lens)])
        return torch.cat([t[b, :, max(txt_lens):].transpose(0, 1) for b in range(2)])

    out_txt, out_img = ref.joint_attention(*(pack(t, "txt") for t in qkv), *(pack(t, "img") for t in qkv),
                                           txt_lens, (img_len, img_len))
    _check("ops_vs_torch", "fp64", out_txt, pack(expected, "txt").reshape(-1, heads * d))
    _check("ops_vs_torch", "fp64", out_img, pack(expected, "img").reshape(-1, heads * d))


def test_latent_pack_roundtrip_and_layout():
    gen = torch.Generator().manual_seed(8)
    z = torch.randn(2, 16, 1, 6, 10, generator=gen, dtype=torch.float64)
    tokens = ref.latent_pack(z)
    assert tokens.shape == (2, 15, 64)
    # docs/design.md §2: pack with view(B, C, H/2, 2, W/2, 2).permute(0, 2, 4, 1, 3, 5).
    expected = z[:, :, 0].reshape(2, 16, 3, 2, 5, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, 15, 64)
    assert torch.equal(tokens, expected)
    assert torch.equal(ref.latent_unpack(tokens, 6, 10), z)
    mean, std = torch.randn(16, generator=gen).tolist(), (1 + torch.rand(16, generator=gen)).tolist()
    _check("ops_vs_torch", "fp64", ref.latent_denormalize(ref.latent_normalize(z, mean, std), mean, std), z)


def test_reference_grads_of_linear():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 4, generator=gen)
    w = torch.randn(3, 4, generator=gen)
    b = torch.randn(3, generator=gen)
    g = torch.randn(5, 3, generator=gen)
    dx, dw, db, none = ref.reference_grads(lambda x, w, b, _: ref.linear(x, w, b), [x, w, b, None], g)
    g64, x64, w64 = g.double(), x.double(), w.double()
    assert none is None and dx.dtype == torch.float64
    _check("ops_vs_torch", "fp64", dx, g64 @ w64)
    _check("ops_vs_torch", "fp64", dw, g64.T @ x64)
    _check("ops_vs_torch", "fp64", db, g64.sum(0))


@pytest.mark.parametrize("shapes", [[(2, 3, 4)], [(1, 4, 6), (1, 2, 5)], [(1, 3, 3), (2, 5, 2)]],
                         ids=["two-frames", "two-images", "mixed"])
def test_rope_tables_match_diffusers_multi_image(shapes):
    """diffusers' list-of-images form: image k starts at frame position k; text follows the largest image."""
    (img_cos, img_sin, txt_cos, txt_sin), = rope_tables([shapes], [6], (4, 6, 6), 10000)
    with _PromoteToFP64():
        rope64 = QwenEmbedRope(theta=10000, axes_dim=[4, 6, 6], scale_rope=True)
        img64, txt64 = rope64([shapes], device=torch.device("cpu"), max_txt_seq_len=6)
    _check_tables("fp64", (img_cos, img_sin, txt_cos, txt_sin), img64, txt64)
