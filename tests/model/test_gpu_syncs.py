"""The strict block makes no host-device synchronisation on the GPU (Qwen-Image widths, one block).

Everything derived from ``seqlens`` (row→sample maps, offsets, RoPE tables) is built before the first
block and cached per batch layout, so a block — forward, and forward + backward — must run with
``torch.cuda.set_sync_debug_mode("error")`` after one warm-up call with the same layout.
"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.kernels.runtime import Runtime, runtime_mode
from mmdit_strict.model import strict
from mmdit_strict.model.rope import packed_rope_tables
from tests.harness import run_without_host_sync
from tests.helpers import strict_qwen_image_cuda

pytestmark = pytest.mark.gpu

GRID = (32, 32)
TXT = (77, 20)


@pytest.fixture(scope="module")
def block_args():
    arch, model = strict_qwen_image_cuda(num_layers=1)
    D, dev = arch.hidden_size, torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    iseq = (GRID[0] * GRID[1],) * len(TXT)

    def rows(n: int) -> torch.Tensor:
        return torch.randn(n, D, generator=gen, device=dev).to(torch.bfloat16)

    img, txt, temb = rows(sum(iseq)), rows(sum(TXT)), rows(len(TXT))
    rope = packed_rope_tables([[(1, *GRID)]] * len(TXT), TXT, arch.axes_dims_rope, arch.rope_theta, dev)
    return model, (0, model.transformer_blocks[0], img, txt, temb, rope, iseq, TXT,
                   arch.num_attention_heads, arch.attention_head_dim, arch.eps)


def test_strict_block_forward_has_no_host_sync(block_args) -> None:
    _, args = block_args
    with runtime_mode(Runtime.STRICT), torch.no_grad():
        warm = strict.block_forward(*args)
        again = run_without_host_sync(lambda: strict.block_forward(*args))
    for a, b in zip(warm, again):
        assert torch.equal(a, b)


def test_strict_block_backward_has_no_host_sync(block_args) -> None:
    model, args = block_args
    model.requires_grad_(True)
    img, txt = args[2].clone().requires_grad_(True), args[3].clone().requires_grad_(True)
    call = args[:2] + (img, txt) + args[4:]

    def step() -> None:
        oi, ot = strict.block_forward(*call)
        torch.autograd.backward((oi, ot), (torch.ones_like(oi), torch.ones_like(ot)))

    with runtime_mode(Runtime.STRICT):
        step()
        run_without_host_sync(step)
    assert img.grad is not None and torch.isfinite(img.grad.float()).all()


def test_input_checks_synchronise_once(block_args) -> None:
    """``validate_inputs`` reads every data check (finite inputs, a 0/1 prefix mask, sigmas in range) and the
    prompt lengths back in one transfer: one host synchronisation per forward on the good path."""
    import warnings

    from tests.helpers import make_inputs

    model, _ = block_args
    inputs = make_inputs(2, (8, 8), [9, 4], txt_dim=model.config.joint_attention_dim, dtype=torch.bfloat16)
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    args = (cuda["hidden_states"], cuda["encoder_hidden_states"], cuda["encoder_hidden_states_mask"], cuda["timestep"],
            cuda["img_shapes"])
    model.validate_inputs(*args)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            got = model.validate_inputs(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert got.txt_lens == [9, 4]
    # the real ones, not the once-per-process notice that the sync debug mode is a prototype
    where = [f"{w.filename}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)]
    assert len(where) == 1, where
