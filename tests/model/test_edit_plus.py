"""Multi-image edit conditioning (Qwen-Image-Edit-Plus, issue 33): several input images per sample, each
with its own grid after the noisy latents' grid.

A sample's bytes alone equal its bytes in a batch mixing image counts and sizes (raw bytes, torch.equal);
the layout matches diffusers' transformer called as its Plus pipeline calls it, within the declared model
tolerances; bad conditioning is refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict import MMDiT
from mmdit_strict.model.edit import ConditionImage, Conditioning, edit_batch, split_conditioning
from mmdit_strict.tolerances import tolerance
from tests.harness import assert_bytes_equal
from tests.model.test_edit_conditioning import GRID, TXT_DIM, cond_image, forward, noisy, prompt, strict_model  # noqa: F401


def several(seed: int, grids: list[tuple[int, int]]) -> Conditioning:
    return Conditioning([cond_image(100 * seed + k, g) for k, g in enumerate(grids)])


def test_img_shapes_list_every_image_after_the_noisy_grid():
    c = several(1, [(2, 3), (4, 1)])
    assert c.tokens == 10 and c.grids == ((2, 3), (4, 1)) and tuple(c.latents.shape) == (10, 64)
    batch = edit_batch(torch.stack([noisy(0), noisy(1)]), [c, cond_image(2, (3, 3))], GRID)
    assert batch.img_shapes == [[(1, 4, 6), (1, 2, 3), (1, 4, 1)], [(1, 4, 6), (1, 3, 3)]]
    assert batch.image_padding and tuple(batch.hidden_states.shape) == (2, 24 + 10, 64)
    assert torch.equal(batch.hidden_states[0, 24:30], c.images[0].latents)
    assert torch.equal(batch.hidden_states[0, 30:], c.images[1].latents)
    assert torch.count_nonzero(batch.hidden_states[1, 24 + 9:]) == 0
    back = split_conditioning(c.latents, [[2, 3], [4, 1]])
    assert isinstance(back, Conditioning) and back.grids == c.grids and torch.equal(back.latents, c.latents)
    assert isinstance(split_conditioning(c.images[0].latents, [[2, 3]]), ConditionImage)


def test_mixed_image_counts_and_sizes_keep_bytes(strict_model):
    mine = several(0, [(2, 2), (3, 2)])
    alone = forward(strict_model, [noisy(0)], [mine], [prompt(0, 5)], [0.7])
    others = [cond_image(11, (5, 3)), several(12, [(1, 4), (2, 2), (3, 3)]), several(13, [(2, 2), (3, 2)])]
    for at in (0, 2, 3):
        ims = list(others)
        ims.insert(at, mine)
        xs = [noisy(20 + k) for k in range(len(others))]
        xs.insert(at, noisy(0))
        ps = [prompt(20 + k, 2 + 3 * k) for k in range(len(others))]
        ps.insert(at, prompt(0, 5))
        sig = [0.2 + 0.1 * k for k in range(len(others))]
        sig.insert(at, 0.7)
        out = forward(strict_model, xs, ims, ps, sig)
        assert_bytes_equal(out[at], alone[0], f"two-image sample at position {at} beside 1- and 3-image samples")


def test_image_order_and_second_image_matter(strict_model):
    a, b = cond_image(30, (2, 2)), cond_image(31, (2, 2))
    v = [forward(strict_model, [noisy(3)], [c], [prompt(3, 4)], [0.5])
         for c in (Conditioning([a, b]), Conditioning([b, a]), a)]
    assert not torch.equal(v[0], v[1]) and not torch.equal(v[0], v[2])


def test_plus_layout_matches_diffusers(tiny_ckpt):
    """Diffusers' transformer, called as QwenImageEditPlusPipeline calls it: hidden states
    cat([noisy, image 1, image 2]) and one img_shapes list per sample, shared by the batch."""
    path, diffusers_model = tiny_ckpt
    conds = [several(40, [(2, 4), (3, 2)]), several(41, [(2, 4), (3, 2)])]
    batch = edit_batch(torch.stack([noisy(8), noisy(9)]), conds, GRID)
    x = torch.cat([torch.stack([noisy(8), noisy(9)]), torch.stack([c.latents for c in conds])], dim=1)
    assert torch.equal(batch.hidden_states, x) and not batch.image_padding
    shapes = [[(1, *GRID), (1, 2, 4), (1, 3, 2)]] * 2
    assert batch.img_shapes == shapes
    ehs, mask = torch.randn(2, 9, TXT_DIM, generator=torch.Generator().manual_seed(5)), torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    kw = dict(hidden_states=x, encoder_hidden_states=ehs, encoder_hidden_states_mask=mask,
              timestep=torch.tensor([0.9, 0.2]), img_shapes=shapes, return_dict=False)
    with torch.no_grad():
        expected = diffusers_model(**kw)[0][:, : GRID[0] * GRID[1]]
        for runtime, name in (("off", "production_vs_diffusers"), ("strict", "strict_vs_diffusers")):
            ours = batch.velocity(MMDiT.from_pretrained(path, runtime=runtime)(**kw)[0])
            passed, max_abs, _ = tolerance("model", name, "fp32").check(ours, expected)
            assert passed, f"{runtime} vs diffusers in the Plus layout: max abs {max_abs:.3e}"


def test_bad_multi_image_conditioning_is_refused():
    with pytest.raises(ValueError, match="at least one ConditionImage"):
        Conditioning([])
    with pytest.raises(ValueError, match="different channel counts"):
        Conditioning([ConditionImage(torch.zeros(4, 64), (2, 2)), ConditionImage(torch.zeros(4, 16), (2, 2))])
    with pytest.raises(ValueError, match=r"must be \(10, C\)"):
        split_conditioning(torch.zeros(9, 64), [[2, 3], [2, 2]])
    with pytest.raises(ValueError, match="one conditioning image per sample"):
        edit_batch(torch.stack([noisy(0), noisy(1)]), [several(0, [(2, 2), (2, 2)])], GRID)
