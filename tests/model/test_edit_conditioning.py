"""Edit conditioning (issue 33): conditioning latents after the noisy latents, two grids per sample.

The strict model keeps a sample's bytes whatever its neighbours' conditioning sizes, prompt padding and
CFG layout are (raw bytes, torch.equal); the edit layout matches diffusers' transformer within the
model tolerances; bad layouts are refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict import MMDiT
from mmdit_strict.config.arch import preset
from mmdit_strict.model import build_model
from mmdit_strict.model.edit import ConditionImage, edit_batch
from mmdit_strict.tolerances import tolerance
from tests.harness import assert_bytes_equal

GRID = (4, 6)  # noisy latents: 24 tokens
TXT_DIM = 48


def cond_image(seed: int, grid: tuple[int, int]) -> ConditionImage:
    g = torch.Generator().manual_seed(500 + seed)
    return ConditionImage(torch.randn(grid[0] * grid[1], 64, generator=g), grid)


def noisy(seed: int) -> torch.Tensor:
    return torch.randn(GRID[0] * GRID[1], 64, generator=torch.Generator().manual_seed(900 + seed))


def prompt(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, TXT_DIM, generator=torch.Generator().manual_seed(700 + seed))


def forward(model: MMDiT, xs: list[torch.Tensor], images: list[ConditionImage], prompts: list[torch.Tensor],
            sigmas: list[float], pad_to: int | None = None) -> torch.Tensor:
    """The velocity rows ``(B, T, 64)`` of one edit batch (prompts padded with garbage the mask drops)."""
    batch = edit_batch(torch.stack(xs), images, GRID)
    L = pad_to or max(p.shape[0] for p in prompts)
    ehs = 5.0 * torch.randn(len(prompts), L, TXT_DIM, generator=torch.Generator().manual_seed(L))
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ehs[b, : p.shape[0]] = p
        mask[b, : p.shape[0]] = 1
    with torch.no_grad():
        out = model(batch.hidden_states, ehs, mask, torch.tensor(sigmas), batch.img_shapes, return_dict=False,
                    image_padding=batch.image_padding)[0]
    return batch.velocity(out)


@pytest.fixture(scope="module")
def strict_model() -> MMDiT:
    return build_model(preset("tiny"), seed=3, runtime="strict")


def test_mixed_conditioning_sizes_keep_bytes(strict_model):
    alone = forward(strict_model, [noisy(0)], [cond_image(0, (4, 4))], [prompt(0, 5)], [0.7])
    # batched with a sample whose input image is larger, and one whose is smaller, at several positions
    for others, at in (([(6, 5)], 0), ([(6, 5)], 1), ([(2, 3), (8, 4)], 1), ([(2, 3), (8, 4)], 2)):
        xs = [noisy(10 + k) for k in range(len(others))]
        ims = [cond_image(10 + k, g) for k, g in enumerate(others)]
        ps = [prompt(10 + k, 3 + 4 * k) for k in range(len(others))]
        sig = [0.3 + 0.1 * k for k in range(len(others))]
        xs.insert(at, noisy(0))
        ims.insert(at, cond_image(0, (4, 4)))
        ps.insert(at, prompt(0, 5))
        sig.insert(at, 0.7)
        out = forward(strict_model, xs, ims, ps, sig)
        assert_bytes_equal(out[at], alone[0], f"edit sample at position {at} beside conditioning grids {others}")


def test_prompt_padding_and_cfg_layout_keep_bytes(strict_model):
    x, im = noisy(1), cond_image(1, (5, 3))
    cond, neg = prompt(1, 7), prompt(2, 2)
    v_cond = forward(strict_model, [x], [im], [cond], [0.5])
    v_neg = forward(strict_model, [x], [im], [neg], [0.5])
    both = forward(strict_model, [x, x], [im, im], [cond, neg], [0.5, 0.5], pad_to=19)  # CFG batched, padded
    assert_bytes_equal(both[0], v_cond[0], "cond branch batched with neg, prompts padded to 19")
    assert_bytes_equal(both[1], v_neg[0], "neg branch batched with cond")


def test_conditioning_changes_the_velocity(strict_model):
    # the conditioning tokens are attended to: another input image gives other noisy-token velocities
    a = forward(strict_model, [noisy(2)], [cond_image(2, (4, 4))], [prompt(3, 4)], [0.6])
    b = forward(strict_model, [noisy(2)], [cond_image(3, (4, 4))], [prompt(3, 4)], [0.6])
    assert not torch.equal(a, b)


def test_padding_rows_are_zero_and_production_matches_strict(strict_model):
    batch = edit_batch(torch.stack([noisy(4), noisy(5)]), [cond_image(4, (2, 2)), cond_image(5, (3, 4))], GRID)
    ehs = torch.stack([prompt(4, 4), prompt(5, 4)])
    t = torch.tensor([0.4, 0.8])
    with torch.no_grad():
        strict = strict_model(batch.hidden_states, ehs, None, t, batch.img_shapes, image_padding=True).sample
        prod = strict_model.set_runtime("off")(batch.hidden_states, ehs, None, t, batch.img_shapes, image_padding=True).sample
        strict_model.set_runtime("strict")
    n0 = GRID[0] * GRID[1] + 4
    assert torch.count_nonzero(strict[0, n0:]) == 0 and torch.count_nonzero(prod[0, n0:]) == 0
    passed, max_abs, _ = tolerance("model", "strict_vs_production", "fp32").check(strict, prod)
    assert passed, f"strict vs production (edit layout, mixed sizes): max abs {max_abs:.3e}"


@pytest.mark.parametrize("runtime", ["off", "strict"])
def test_edit_layout_matches_diffusers(tiny_ckpt, runtime):
    path, diffusers_model = tiny_ckpt
    ours = MMDiT.from_pretrained(path, runtime=runtime)
    batch = edit_batch(torch.stack([noisy(6), noisy(7)]), [cond_image(6, (6, 2)), cond_image(7, (6, 2))], GRID)
    ehs, mask = torch.randn(2, 9, TXT_DIM), torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    kw = dict(hidden_states=batch.hidden_states, encoder_hidden_states=ehs, encoder_hidden_states_mask=mask,
              timestep=torch.tensor([0.9, 0.2]), img_shapes=batch.img_shapes, return_dict=False)
    with torch.no_grad():
        expected = batch.velocity(diffusers_model(**kw)[0])
        ours_v = batch.velocity(ours(**kw)[0])
    name = "production_vs_diffusers" if runtime == "off" else "strict_vs_diffusers"
    passed, max_abs, _ = tolerance("model", name, "fp32").check(ours_v, expected)
    assert passed, f"{runtime} vs diffusers in the edit layout: max abs {max_abs:.3e}"


def test_bad_edit_layouts_are_refused(strict_model):
    x = torch.stack([noisy(0), noisy(1)])
    with pytest.raises(ValueError, match="one conditioning image per sample"):
        edit_batch(x, [cond_image(0, (2, 2))], GRID)
    with pytest.raises(ValueError, match=r"must be \(6, C\)"):
        ConditionImage(torch.zeros(5, 64), (2, 3))
    batch = edit_batch(x, [cond_image(0, (2, 2)), cond_image(1, (3, 3))], GRID)
    ehs = torch.randn(2, 3, TXT_DIM)
    with pytest.raises(ValueError, match="describe 28 tokens but hidden_states has 33"):
        strict_model(batch.hidden_states, ehs, None, torch.tensor([0.5, 0.5]), batch.img_shapes)  # no image_padding
    with pytest.raises(ValueError, match="pad to the longest sample"):
        wide = torch.cat([batch.hidden_states, batch.hidden_states[:, :1]], dim=1)
        strict_model(wide, ehs, None, torch.tensor([0.5, 0.5]), batch.img_shapes, image_padding=True)
    with pytest.raises(ValueError, match="one list of"):
        strict_model(batch.hidden_states, ehs, None, torch.tensor([0.5, 0.5]), (1, 3, 11), image_padding=True)
