"""The GEMM stream (kernels.streams): the text stream's tiles, how the engine and the strict model use them.

A stream's tile must keep the image tile's K step (each output element's accumulator chain, hence its bytes);
it is bound by the caller for where a product sits in the model, never chosen from the number of rows.
"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.kernels.streams import current_gemm_stream, gemm_stream
from mmdit_strict.kernels.triton import configs as C

_TEXT_CLASSES = [(3072, 3072), (3072, 12288), (64, 3072), (64, 12288)]  # q/k/v + attn_out, mlp_down; LoRA u / v


def test_text_stream_tiles_keep_the_image_k_step_and_differ_only_where_listed() -> None:
    for (n, k, dt), cfg in C.FWD_TEXT.items():
        image = C.FWD[(n, k, dt)]
        assert cfg.BLOCK_K == image.BLOCK_K, f"({n}, {k}) text tile changes the K step: {cfg} vs {image}"
        assert cfg != image
    assert sorted(C.FWD_TEXT) == sorted((n, k, dt) for n, k in _TEXT_CLASSES for dt in ("bf16", "fp32"))
    for n, k in _TEXT_CLASSES:
        for dtype, dt in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            assert C.fwd_config(n, k, dtype, "text") == C.FWD_TEXT[(n, k, dt)]
            assert C.fwd_config(n, k, dtype, "image") == C.FWD[(n, k, dt)]
    # classes without a text entry (mlp_up, the modulation projections) take the image table in both streams
    for n, k in [(12288, 3072), (18432, 3072), (6144, 3072)]:
        assert C.fwd_config(n, k, torch.bfloat16, "text") == C.fwd_config(n, k, torch.bfloat16)
    with pytest.raises(ValueError, match="GEMM stream must be one of"):
        C.fwd_config(3072, 3072, torch.bfloat16, "audio")


def test_gemm_stream_binds_for_the_block_and_refuses_unknown_names() -> None:
    assert current_gemm_stream() == "image"
    with gemm_stream("text"):
        assert current_gemm_stream() == "text"
        with gemm_stream("image"):
            assert current_gemm_stream() == "image"
        assert current_gemm_stream() == "text"
    assert current_gemm_stream() == "image"
    with pytest.raises(ValueError, match="gemm stream must be one of"), gemm_stream("txt"):
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors); the GPU test below covers CUDA")
def test_engine_forward_asks_for_the_bound_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """gemm_fwd's default configuration is looked up for the stream in force (real lookups, recorded)."""
    from mmdit_strict.kernels.triton import gemm as G

    seen: list[str] = []
    real = C.fwd_config
    monkeypatch.setattr(C, "fwd_config", lambda n, k, dtype, stream="image": seen.append(stream) or real(n, k, dtype, stream))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 16, generator=g), torch.randn(24, 16, generator=g)
    plain = G.gemm_fwd(x, w)[0]
    with gemm_stream("text"):
        text = G.gemm_fwd(x, w)[0]
    assert seen == ["image", "text"]
    assert torch.equal(plain, text)  # no text entry at this size: the same tile, the same bytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors); the GPU test below covers CUDA")
def test_engine_backward_takes_dx_tiles_from_the_forwards_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward runs outside the forward's context (autograd's thread on CUDA): dX's tile is looked up for the
    stream the forward ran in, kept by the autograd node."""
    from mmdit_strict.kernels.triton import gemm as G

    seen: list[tuple[int, int, str]] = []
    real = C.fwd_config
    monkeypatch.setattr(C, "fwd_config", lambda n, k, dtype, stream="image": seen.append((n, k, stream)) or real(n, k, dtype, stream))
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 16, generator=g, requires_grad=True), torch.randn(24, 16, generator=g)
    with gemm_stream("text"):
        y = G.gemm(x, w, seqlens=(5,))
    y.sum().backward()  # outside the text block
    assert seen == [(24, 16, "text"), (16, 24, "text")]  # forward (N, K), then dX (K, N)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
def test_engine_lora_products_take_the_forwards_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """u = x Aᵀ in the forward and v = dZ B in the backward are looked up for the stream the forward ran in."""
    from mmdit_strict.kernels.triton import gemm as G

    seen: list[tuple[int, int, str]] = []
    real = C.fwd_config
    monkeypatch.setattr(C, "fwd_config", lambda n, k, dtype, stream="image": seen.append((n, k, stream)) or real(n, k, dtype, stream))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 16, generator=g, requires_grad=True)
    w, a = torch.randn(24, 16, generator=g), torch.randn(4, 16, generator=g, requires_grad=True)
    b = torch.randn(24, 4, generator=g, requires_grad=True)
    with gemm_stream("text"):
        y = G.gemm(x, w, lora=(a, b, 2.0), seqlens=(5,))
    y.sum().backward()
    assert seen == [(24, 16, "text"), (4, 16, "text"), (4, 24, "text"), (16, 24, "text")]  # main, u; v, dX


def test_strict_model_binds_the_text_stream_for_text_products_only(tiny_ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GEMM-family call of the strict forward sees the stream of the side it sits on."""
    from mmdit_strict import MMDiT
    from mmdit_strict.model import strict
    from tests.helpers import make_inputs

    gemm_ops = {"qkv_bias_gemm", "attn_out_bias_gemm", "mlp_up_gemm_gelu", "mlp_down_gemm", "adaln_mod_projection"}
    calls: list[tuple[str, str, str]] = []
    real = strict._op

    def spy(op, where, *args, **kw):
        if op in gemm_ops:
            calls.append((op, where, current_gemm_stream()))
        return real(op, where, *args, **kw)

    monkeypatch.setattr(strict, "_op", spy)
    model = MMDiT.from_pretrained(tiny_ckpt[0], runtime="strict")
    with torch.no_grad():
        model(**make_inputs(2, (4, 4), [5, 3]))
    assert calls, "no GEMM-family call observed"
    for op, where, stream in calls:
        want = "text" if ".txt" in where else "image"
        assert stream == want, f"{op} at {where} ran in the {stream} stream"
    assert {s for _, _, s in calls} == {"image", "text"}
    assert current_gemm_stream() == "image"


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", _TEXT_CLASSES[:2] + [(3072, 3584)])
def test_gpu_text_tiles_give_the_image_tiles_bytes(n: int, k: int) -> None:
    """bf16 on the H200: the text stream's forward tile and the image stream's give the same bytes at prompt-sized
    and image-sized row counts (txt_in, whose class now runs the text tile, against the image table's big tile)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from mmdit_strict.kernels.triton import gemm as G

    big = C._BIG_BF16.replace(weight_layout="nk")  # the image stream's big tile as the model's classes read it
    text = C.fwd_config(n, k, torch.bfloat16, "text")
    image = C.fwd_config(n, k, torch.bfloat16, "image")
    if image == text:  # txt_in: compare with the big tile its class ran before
        image = big
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    for m in (1, 77, 128, 144, 256, 300, 4224):
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        want = G.gemm_fwd(x, w, b, config=image)[0]
        got = G.gemm_fwd(x, w, b, config=text)[0]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"({n}, {k}) M={m}: text tile moved bytes"


@pytest.mark.gpu
def test_gpu_fp32_text_tiles_give_the_big_tiles_bytes() -> None:
    """fp32 on the H200: the text tile (32 x 64) of the text stream's classes and of txt_in's forward (3072, 3584)
    and dX (3584, 3072) gives the bytes of the 64 x 128 tile they ran before (the same 32-wide K step), at
    prompt-sized (and for txt_in image-sized) row counts."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from mmdit_strict.kernels.triton import gemm as G

    assert C.fwd_config(3072, 3584, torch.float32) == C.fwd_config(3584, 3072, torch.float32) == C._TEXT_FP32
    g = torch.Generator(device="cuda").manual_seed(11)
    for n, k in _TEXT_CLASSES[:2]:  # the text stream's fp32 classes against the image tile
        w = torch.randn(n, k, device="cuda", generator=g) * k**-0.5
        for m in (1, 77, 256, 300):
            x = torch.randn(m, k, device="cuda", generator=g)
            want = G.gemm_fwd(x, w, None, config=C.fwd_config(n, k, torch.float32, "image"))[0]
            got = G.gemm_fwd(x, w, None, config=C.fwd_config(n, k, torch.float32, "text"))[0]
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"({n}, {k}) fp32 M={m}: text tile moved bytes"
    w = torch.randn(3072, 3584, device="cuda", generator=g) * 3584**-0.5
    b = torch.randn(3072, device="cuda", generator=g)
    for m in (1, 77, 256, 300, 4224):
        x = torch.randn(m, 3584, device="cuda", generator=g)
        want = G.gemm_fwd(x, w, b, config=C._BIG_FP32)[0]
        got = G.gemm_fwd(x, w, b)[0]
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"txt_in fp32 fwd M={m}: the tile moved bytes"
        dz = torch.randn(m, 3072, device="cuda", generator=g)
        needs = (True, False, False, False, False)
        want = G.gemm_bwd(dz, x, w, seqlens=(m,), needs=needs, dx_config=C._BIG_FP32)[0]
        got = G.gemm_bwd(dz, x, w, seqlens=(m,), needs=needs)[0]
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"txt_in fp32 dX M={m}: the tile moved bytes"


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(3072, 3072), (12288, 3072)])  # layers whose dX class (K, N) has a text tile
def test_gpu_text_dx_tiles_give_the_image_tiles_bytes(n: int, k: int) -> None:
    """On the H200: dX = dZ W of a text-stream layer through the text table's tile for (K, N) equals the image
    tile's bytes (the same K step), bf16 and fp32, with and without a LoRA term, at prompt-sized row counts."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from mmdit_strict.kernels.triton import gemm as G

    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        text, image = C.fwd_config(k, n, dtype, "text"), C.fwd_config(k, n, dtype, "image")
        assert text != image
        g = torch.Generator(device="cuda").manual_seed(n * 3 + k)
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dtype)
        la = (torch.randn(64, k, device="cuda", generator=g) * k**-0.5).to(dtype)
        lb = (torch.randn(n, 64, device="cuda", generator=g) * 0.125).to(dtype)
        for m in (1, 77, 128, 300):
            x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
            dz = torch.randn(m, n, device="cuda", generator=g).to(dtype)
            for lora in (None, (la, lb, 2.0)):
                u = G.gemm_fwd(x, w, lora=lora)[2]
                need = (True, False, False, False, False)
                want = G.gemm_bwd(dz, x, w, seqlens=(m,), lora=lora, u=u, needs=need, dx_config=image)[0]
                got = G.gemm_bwd(dz, x, w, seqlens=(m,), lora=lora, u=u, needs=need, dx_config=text)[0]
                assert torch.equal(got.view(bits), want.view(bits)), f"{dtype} ({n}, {k}) dX M={m} lora={lora is not None}"



@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(3072, 3072), (3072, 12288), (12288, 3072)])  # q/k/v + attn_out, mlp_down, mlp_up
def test_gpu_text_lora_products_give_the_image_streams_bytes(n: int, k: int) -> None:
    """On the H200: a LoRA layer's forward and backward run in the text stream (its rank-64 ``u`` / ``v`` on the text
    table's 16-row tiles) give the image stream's bytes for y, u, dX, dA and dB, bf16 and fp32, at prompt-sized and
    larger row counts."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from mmdit_strict.kernels.triton import gemm as G

    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        assert C.fwd_config(64, k, dtype, "text") != C.fwd_config(64, k, dtype, "image")  # u takes another tile
        g = torch.Generator(device="cuda").manual_seed(n + 7 * k)
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dtype)
        la = (torch.randn(64, k, device="cuda", generator=g) * k**-0.5).to(dtype)
        lb = (torch.randn(n, 64, device="cuda", generator=g) * 0.125).to(dtype)
        lora = (la, lb, 2.0)
        for m in (1, 77, 128, 300):
            x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
            dz = torch.randn(m, n, device="cuda", generator=g).to(dtype)
            outs = {}
            for stream in ("image", "text"):
                with gemm_stream(stream):
                    y, _, u = G.gemm_fwd(x, w, lora=lora)
                dx, _, _, da, dlb = G.gemm_bwd(dz, x, w, seqlens=(m,), lora=lora, u=u,
                                               needs=(True, False, False, True, True), stream=stream)
                outs[stream] = (y, u, dx, da, dlb)
            for name, want, got in zip(("y", "u", "dX", "dA", "dB"), outs["image"], outs["text"]):
                assert torch.equal(got.view(bits), want.view(bits)), f"{dtype} ({n}, {k}) M={m}: text stream moved {name}"
