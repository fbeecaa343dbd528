"""Issue 3 "Done when": the tiny strict model gives the same raw bytes however a sample is run.

B = 1 vs 2, 3, 8; every batch position; text padding from 0 to N extra tokens; CFG branches batched
(cond and neg prompts of different lengths in one batch of 2B) vs one by one; gradient checkpointing
on vs off; repeated runs — forward bytes and gradients, including per-sample LoRA gradients, which
must equal the left fold (in sample order) of each sample's gradient computed alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from mmdit_strict import MMDiT
from tests.harness import assert_bytes_equal, check_padding_invariance, left_fold

GRID = (6, 5)  # 30 image tokens: not a multiple of the 32-row tile
TXT_DIM = 48
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "img_mlp.net.0.proj"]


@dataclass(frozen=True)
class Sample:
    """One logical sample: its latents, its valid prompt rows and its sigma."""

    latents: torch.Tensor  # (T_img, 64)
    prompt: torch.Tensor  # (L_valid, 48)
    sigma: float
    target: torch.Tensor  # (T_img, 64): a fixed per-sample regression target for the loss


def make_sample(seed: int, txt_len: int, sigma: float | None = None) -> Sample:
    g = torch.Generator().manual_seed(1000 + seed)
    t = GRID[0] * GRID[1]
    return Sample(
        latents=torch.randn(t, 64, generator=g),
        prompt=torch.randn(txt_len, TXT_DIM, generator=g),
        sigma=float(torch.rand((), generator=g)) if sigma is None else sigma,
        target=torch.randn(t, 64, generator=g),
    )


def batch_inputs(samples: list[Sample], pad_to: int | None = None, garbage_seed: int = 0) -> dict:
    """Stack samples into diffusers-style inputs; padded prompt positions hold random garbage (masked out)."""
    lens = [s.prompt.shape[0] for s in samples]
    L = pad_to if pad_to is not None else max(lens)
    g = torch.Generator().manual_seed(50_000 + garbage_seed)
    ehs = 7.0 * torch.randn(len(samples), L, TXT_DIM, generator=g)
    mask = torch.zeros(len(samples), L, dtype=torch.long)
    for b, s in enumerate(samples):
        ehs[b, : lens[b]] = s.prompt
        mask[b, : lens[b]] = 1
    return dict(
        hidden_states=torch.stack([s.latents for s in samples]),
        encoder_hidden_states=ehs,
        encoder_hidden_states_mask=mask,
        timestep=torch.tensor([s.sigma for s in samples], dtype=torch.float32),
        img_shapes=[[(1, *GRID)]] * len(samples),
    )


def velocity(model: MMDiT, samples: list[Sample], **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch_inputs(samples, **kw)).sample


def loss_of(out: torch.Tensor, samples: list[Sample]) -> torch.Tensor:
    """Sum over samples of a fixed per-sample function of that sample's own output (flow-matching MSE)."""
    target = torch.stack([s.target for s in samples])
    return ((out - target) ** 2).mean(dim=(1, 2)).sum()


def grads(model: MMDiT, samples: list[Sample], params: list[torch.Tensor], **kw) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    inputs = batch_inputs(samples, **kw)
    out = model(**inputs).sample
    g = torch.autograd.grad(loss_of(out, samples), params, allow_unused=True)
    return out.detach(), tuple(torch.zeros_like(p) if x is None else x for p, x in zip(params, g))


POOL = [make_sample(i, n) for i, n in enumerate([5, 13, 1, 9, 17, 3, 11, 7, 14, 2])]


@pytest.fixture(scope="module")
def strict_model(tiny_ckpt):
    return MMDiT.from_pretrained(tiny_ckpt[0], runtime="strict")


@pytest.fixture(scope="module")
def singletons(strict_model):
    return [velocity(strict_model, [s])[0] for s in POOL]


# ------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("batch", [2, 3, 8])
def test_batch_size_and_position(strict_model, singletons, batch):
    g = torch.Generator().manual_seed(batch)
    for trial in range(2):
        idx = torch.randperm(len(POOL), generator=g)[:batch].tolist()
        out = velocity(strict_model, [POOL[i] for i in idx])
        for pos, i in enumerate(idx):
            assert_bytes_equal(out[pos], singletons[i], f"B={batch} trial {trial}: sample {i} at position {pos} vs B=1")
        rev = velocity(strict_model, [POOL[i] for i in reversed(idx)])
        assert_bytes_equal(rev.flip(0), out, f"B={batch}: reversed batch")


def test_every_position_of_a_probe(strict_model, singletons):
    probe, others = 4, [POOL[i] for i in (0, 1, 2, 5, 6, 7, 8)]
    for pos in range(len(others) + 1):
        batch = others[:pos] + [POOL[probe]] + others[pos:]
        assert_bytes_equal(velocity(strict_model, batch)[pos], singletons[probe], f"probe at position {pos} of 8")


def test_text_padding_0_to_n(strict_model, singletons):
    for i in (0, 2, 4):
        n = POOL[i].prompt.shape[0]
        check_padding_invariance(lambda extra: velocity(strict_model, [POOL[i]], pad_to=n + extra, garbage_seed=extra)[0],
                                 range(0, 25), what=f"sample {i} ({n} text tokens)")
        assert_bytes_equal(velocity(strict_model, [POOL[i]])[0], singletons[i], f"sample {i} unpadded")


def test_padding_inside_a_batch(strict_model, singletons):
    batch = [POOL[1], POOL[2], POOL[3]]
    for pad in (17, 18, 40):
        out = velocity(strict_model, batch, pad_to=pad, garbage_seed=pad)
        for pos, i in enumerate((1, 2, 3)):
            assert_bytes_equal(out[pos], singletons[i], f"batch padded to {pad}: sample {i}")


@pytest.mark.parametrize("n_prompts", [1, 2])
def test_cfg_branches_batched_vs_one_by_one(strict_model, n_prompts):
    """cond and neg prompts (different lengths) of the same latents, batched as [cond..., neg...] (2B)."""
    conds = [make_sample(100 + b, 9 + 4 * b, sigma=0.4 + 0.1 * b) for b in range(n_prompts)]
    negs = [Sample(c.latents, torch.randn(2 + 3 * b, TXT_DIM, generator=torch.Generator().manual_seed(b)), c.sigma, c.target)
            for b, c in enumerate(conds)]
    batched = velocity(strict_model, conds + negs)
    branch_cond, branch_neg = velocity(strict_model, conds), velocity(strict_model, negs)
    for b in range(n_prompts):
        alone_c, alone_n = velocity(strict_model, [conds[b]])[0], velocity(strict_model, [negs[b]])[0]
        assert_bytes_equal(batched[b], alone_c, f"CFG 2B batch: cond {b} vs alone")
        assert_bytes_equal(batched[n_prompts + b], alone_n, f"CFG 2B batch: neg {b} vs alone")
        assert_bytes_equal(branch_cond[b], alone_c, f"cond branch batch: {b} vs alone")
        assert_bytes_equal(branch_neg[b], alone_n, f"neg branch batch: {b} vs alone")
    assert not torch.equal(batched[0], batched[n_prompts]), "cond and neg should differ (different prompts)"


def test_repeated_forward(strict_model):
    batch = [POOL[i] for i in (3, 1, 4)]
    first = velocity(strict_model, batch)
    for _ in range(2):
        assert_bytes_equal(velocity(strict_model, batch), first, "repeated strict forward")


def test_grad_mode_does_not_change_forward_bytes(strict_model, singletons):
    out = strict_model(**batch_inputs([POOL[0], POOL[5]])).sample
    assert out.requires_grad
    assert_bytes_equal(out[0].detach(), singletons[0], "forward under autograd vs no_grad")
    assert_bytes_equal(out[1].detach(), singletons[5], "forward under autograd vs no_grad")


# ------------------------------------------------------------------------------------------ gradients


@pytest.fixture(scope="module")
def lora_model(tiny_ckpt):
    peft = pytest.importorskip("peft")
    model = MMDiT.from_pretrained(tiny_ckpt[0], runtime="strict")
    cfg = peft.LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS, init_lora_weights=False)
    torch.manual_seed(123)
    model = peft.inject_adapter_in_model(cfg, model)
    return model


def lora_params(model: MMDiT) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if "lora_" in n]


def test_lora_is_applied_unmerged_in_strict(lora_model, tiny_ckpt):
    """Strict reads the PEFT layers: its output moves with the adapter and matches production with it."""
    from mmdit_strict.tolerances import tolerance

    names = [n for n, _ in lora_params(lora_model)]
    assert len(names) == 2 * 2 * len(LORA_TARGETS), f"expected A and B for {len(LORA_TARGETS)} targets in 2 blocks, got {names}"
    plain = MMDiT.from_pretrained(tiny_ckpt[0], runtime="strict")
    batch = [POOL[0], POOL[1]]
    with_lora = velocity(lora_model, batch)
    assert not torch.equal(with_lora, velocity(plain, batch)), "the LoRA adapter had no effect in strict mode"
    lora_model.set_runtime("off")
    try:
        prod = velocity(lora_model, batch)
    finally:
        lora_model.set_runtime("strict")
    tol = tolerance("model", "strict_vs_production", "fp32")
    ok, max_abs, max_rel = tol.check(with_lora, prod)
    assert ok, f"strict vs production with LoRA: max abs {max_abs:.3e}, max rel {max_rel:.3e}"


@pytest.mark.parametrize("order", [(0, 1, 2), (4, 2, 9, 3, 0)])
def test_lora_grads_batch_equal_fold_of_singletons(lora_model, order):
    named = lora_params(lora_model)
    params = [p for _, p in named]
    samples = [POOL[i] for i in order]
    out_b, g_batch = grads(lora_model, samples, params)
    alone = [grads(lora_model, [s], params) for s in samples]
    for pos, (out_1, _) in enumerate(alone):
        assert_bytes_equal(out_b[pos], out_1[0], f"LoRA model forward, sample {order[pos]} batched vs alone")
    # The last block's text queries reach no image output, so their adapter's gradient is exactly zero.
    dead = f"transformer_blocks.{lora_model.config.num_layers - 1}.attn.add_q_proj."
    for k, (name, _) in enumerate(named):
        assert (g_batch[k].abs().sum() > 0) != name.startswith(dead), f"{name}: unexpected gradient {float(g_batch[k].abs().sum())}"
        assert_bytes_equal(g_batch[k], left_fold([a[1][k] for a in alone]), f"{name}: batch grad vs left fold of singletons")


def test_all_parameter_grads_batch_equal_fold_of_singletons(strict_model):
    """Not only LoRA points: every base parameter's gradient folds per sample in sample order too."""
    named = list(strict_model.named_parameters())
    params = [p for _, p in named]
    samples = [POOL[i] for i in (1, 6, 2)]
    _, g_batch = grads(strict_model, samples, params)
    alone = [grads(strict_model, [s], params)[1] for s in samples]
    for k, (name, _) in enumerate(named):
        assert_bytes_equal(g_batch[k], left_fold([a[k] for a in alone]), f"{name}: batch grad vs left fold of singletons")


def test_gradient_checkpointing_same_bytes(lora_model):
    base = [lora_model.img_in.weight, lora_model.txt_norm.weight, lora_model.transformer_blocks[0].attn.norm_k.weight]
    params = [p for _, p in lora_params(lora_model)] + base  # PEFT froze the base weights; unfreeze a few
    samples = [POOL[i] for i in (7, 2, 4)]
    try:
        for p in base:
            p.requires_grad_(True)
        lora_model.enable_gradient_checkpointing(False)
        out_off, g_off = grads(lora_model, samples, params)
        lora_model.enable_gradient_checkpointing(True)
        out_on, g_on = grads(lora_model, samples, params)
    finally:
        lora_model.enable_gradient_checkpointing(False)
        for p in base:
            p.requires_grad_(False)
    assert_bytes_equal(out_on, out_off, "forward with gradient checkpointing vs without")
    for k in range(len(params)):
        assert_bytes_equal(g_on[k], g_off[k], f"param {k} grad with checkpointing vs without")


def test_input_grads_batch_invariant(strict_model):
    """d loss / d latents of a sample does not depend on its batch."""
    samples = [POOL[i] for i in (3, 0, 8)]

    def dlatents(batch):
        inputs = batch_inputs(batch)
        hs = inputs["hidden_states"].requires_grad_(True)
        out = strict_model(**inputs).sample
        (g,) = torch.autograd.grad(loss_of(out, batch), [hs])
        return g

    batched = dlatents(samples)
    for pos, s in enumerate(samples):
        assert_bytes_equal(batched[pos], dlatents([s])[0], f"d loss/d latents of sample at position {pos}")


def test_repeated_backward(lora_model):
    params = [p for _, p in lora_params(lora_model)]
    samples = [POOL[i] for i in (5, 1)]
    first = grads(lora_model, samples, params)
    assert_bytes_equal(grads(lora_model, samples, params), first, "repeated forward + backward")
