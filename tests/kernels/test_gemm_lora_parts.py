"""The LoRA term per epilogue column part: cutting a tile's epilogue into 1, 2 or 4 parts moves no byte of a LoRA
layer's forward (y, the stored pre-activation) or dX on the H200, at the model's layer classes and both streams.

(The interpreter covers the same property at tiny tiles: tests/kernels/test_triton_gemm.py,
``test_launch_variants_give_the_same_bytes``.)"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.kernels.streams import gemm_stream
from mmdit_strict.kernels.triton import configs as C


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,epi", [(3072, 3072, "none"), (3072, 12288, "gelu_tanh"), (12288, 3072, "none")])
def test_gpu_lora_epilogue_parts_give_the_same_bytes(k: int, n: int, epi: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from mmdit_strict.kernels.triton.gemm import launch as L

    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        g = torch.Generator(device="cuda").manual_seed(k + n)
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dtype)
        b = (0.1 * torch.randn(n, device="cuda", generator=g)).to(dtype)
        lora = ((torch.randn(64, k, device="cuda", generator=g) * k**-0.5).to(dtype),
                (torch.randn(n, 64, device="cuda", generator=g) * 0.125).to(dtype), 2.0)
        store = epi != "none"
        for stream, rows in (("image", (1, 77, 300, 4224)), ("text", (1, 77, 128))):
            for m in rows:
                x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
                dy = torch.randn(m, n, device="cuda", generator=g).to(dtype)
                runs = []
                for split in (1, 2, 4):
                    fwd = C.fwd_config(n, k, dtype, stream).replace(epi_split=split)
                    dxc = C.fwd_config(k, n, dtype, stream).replace(epi_split=split)
                    with gemm_stream(stream):
                        y, pre, u = L.gemm_fwd(x, w, b, epilogue=epi, store_pre=store, lora=lora, config=fwd)
                    dx = L.gemm_bwd(dy, x, w, seqlens=(m,), epilogue=epi, pre=pre, lora=lora, u=u,
                                    needs=(True, False, False, False, False), dx_config=dxc, stream=stream)[0]
                    runs.append([t for t in (y, pre, dx) if t is not None])
                for split, got in zip((2, 4), runs[1:]):
                    for name, want, have in zip(("y", "pre", "dX") if store else ("y", "dX"), runs[0], got):
                        assert torch.equal(have.view(bits), want.view(bits)), (
                            f"{dtype} {k}->{n} {stream} M={m}: {split} epilogue parts moved {name}")
