"""Column shards of a GEMM (tensor parallelism): a shard's product is the whole product's columns, on the CPU
strict engine and on the Triton engine (interpreter here), and the probe that guards it refuses where it is not.
"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.kernels.execution import execution
from mmdit_strict.kernels.streams import configured_columns, gemm_columns
from mmdit_strict.model.strict import gemm_params
from mmdit_strict.parallel import tensor as T


def _layer(n: int, k: int, seed: int = 0, lora: bool = True):
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    lo = (torch.randn(4, k, generator=g), torch.randn(n, 4, generator=g), 0.5) if lora else None
    return w, b, lo


def _shard_equals_whole(n: int, k: int, tp: int, epilogue: str = "none") -> bool:
    w, b, lo = _layer(n, k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1))
    whole = gemm_params("mlp_up_gemm_gelu", "t", x, w, b, lo, (23, 17), epilogue=epilogue)
    step = n // tp
    with gemm_columns(n):
        parts = [gemm_params("mlp_up_gemm_gelu", "t", x, w[j * step:(j + 1) * step], b[j * step:(j + 1) * step],
                             (lo[0], lo[1][j * step:(j + 1) * step], lo[2]), (23, 17), epilogue=epilogue)
                 for j in range(tp)]
    return all(torch.equal(p, whole[:, j * step:(j + 1) * step]) for j, p in enumerate(parts))


def test_gemm_columns_binds_the_whole_layer_for_the_block() -> None:
    assert configured_columns(64) == 64
    with gemm_columns(256):
        assert configured_columns(64) == 256
        with gemm_columns(None):
            assert configured_columns(64) == 64
    assert configured_columns(64) == 64
    with pytest.raises(ValueError, match="positive int"):
        gemm_columns(0)


@pytest.mark.parametrize("tp", [2, 4])
def test_cpu_column_shards_of_16_aligned_width_are_the_whole_products_columns(tp: int) -> None:
    """The CPU tile product (MKL here) gives a shard whose width is a multiple of 16 the whole product's bytes
    (LoRA and the tanh-GELU epilogue included): the widths the tiny and the Qwen-Image models shard."""
    with execution(runtime="strict"):
        assert _shard_equals_whole(128, 48, tp, "gelu_tanh")
        assert _shard_equals_whole(64 * tp, 32, tp)


def test_the_probe_refuses_exactly_where_shards_change_bytes() -> None:
    """The probe's verdict is the raw-bytes comparison itself: for every shape it passes where the shards equal
    the whole product and names the shape where they do not (this CPU BLAS blocks columns by 16, so 8-wide
    shards of some shapes differ — the refusal is exercised wherever the platform has such shapes)."""
    refused = 0
    with execution(runtime="strict"):
        for n, k, tp in [(32, 48, 4), (24, 64, 3), (64, 40, 8), (128, 32, 2)]:
            w, b, lo = _layer(n, k)
            x = torch.randn(3, k)
            verdict = T._probe("mlp_down_gemm", w, b, lo, x, "image", {}, tp)
            rows = torch.randn(T.PROBE_ROWS, k, generator=torch.Generator().manual_seed(n * 7919 + k))
            whole = gemm_params("mlp_down_gemm", "t", rows, w, b, lo, (T.PROBE_ROWS,))
            s = n // tp
            equal = all(torch.equal(gemm_params("mlp_down_gemm", "t", rows, w[j * s:(j + 1) * s], b[j * s:(j + 1) * s],
                                                (lo[0], lo[1][j * s:(j + 1) * s], lo[2]), (T.PROBE_ROWS,)),
                                    whole[:, j * s:(j + 1) * s]) for j in range(tp))
            assert (verdict == "") == equal, (n, k, tp, verdict)
            refused += verdict != ""
    if refused == 0:
        pytest.skip("every probed shape splits exactly on this platform: the refusal path was not reached")


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors); tests/parallel/test_gpu_layouts.py covers CUDA")
def test_triton_shard_takes_the_whole_layers_configuration_and_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under gemm_columns the engine looks the shard's configuration up by the whole layer's N (a 256-wide shard
    of a 512-wide layer would otherwise take the tiny-layer tile with another K step), and the shard's bytes
    are the whole product's columns."""
    from mmdit_strict.kernels.triton import configs as C
    from mmdit_strict.kernels.triton import gemm as G

    seen: list[int] = []
    real = C.fwd_config
    monkeypatch.setattr(C, "fwd_config", lambda n, k, dtype, stream="image": seen.append(n) or real(n, k, dtype, stream))
    assert real(256, 64, torch.float32).BLOCK_K != real(512, 64, torch.float32).BLOCK_K  # the lookup matters here
    w, b, _ = _layer(512, 64, lora=False)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    whole = G.gemm_fwd(x, w, b)[0]
    with gemm_columns(512):
        part = G.gemm_fwd(x, w[256:], b[256:])[0]
    assert seen == [512, 512]
    assert torch.equal(part, whole[:, 256:])
