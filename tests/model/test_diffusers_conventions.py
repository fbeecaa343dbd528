"""diffusers habits on MMDiT: every img_shapes form, torch_dtype / from_config / to_tuple,
attention_kwargs, and diffusers' LoRA methods (loading with bounded host memory: test_checkpoint.py)."""

from __future__ import annotations

import pytest
import torch

from mmdit_strict import MMDiT
from mmdit_strict.config.arch import preset
from mmdit_strict.model.rope import normalize_img_shapes
from mmdit_strict.tolerances import tolerance
from tests.harness import assert_bytes_equal
from tests.helpers import make_inputs


@pytest.fixture(scope="module")
def ours(tiny_ckpt):
    return MMDiT.from_pretrained(tiny_ckpt[0], runtime="off")


def _out(model, inputs, **kw):
    with torch.no_grad():
        return model(**{**inputs, **kw}).sample


# ------------------------------------------------------------------------------------ img_shapes
@pytest.mark.parametrize(
    "form, batch, tokens, expected",
    [
        ((1, 3, 4), 2, 12, [[(1, 3, 4)]] * 2),  # one triple, shared
        ([(1, 3, 4)] * 2, 2, 12, [[(1, 3, 4)]] * 2),  # diffusers' flat per-sample form, len == B
        ([(1, 3, 4), (1, 4, 3)], 2, 12, [[(1, 3, 4)], [(1, 4, 3)]]),  # flat per-sample, grids differ
        ([(1, 3, 4), (1, 2, 2)], 2, 16, [[(1, 3, 4), (1, 2, 2)]] * 2),  # flat multi-grid list shared (sum == T)
        ([(1, 3, 4)], 3, 12, [[(1, 3, 4)]] * 3),  # one-element list, shared
        ([(1, 3, 4)] * 2, 4, 12, [[(1, 3, 4)]] * 4),  # num_images_per_prompt: len divides B, equal entries
        ([[(1, 3, 4)]] * 2, 2, 12, [[(1, 3, 4)]] * 2),  # QwenImagePipeline's form
        ([[(1, 3, 4)]], 4, 12, [[(1, 3, 4)]] * 4),  # pipeline form with num_images_per_prompt
        ([[(1, 3, 4)], [(1, 4, 3)]], 2, 12, [[(1, 3, 4)], [(1, 4, 3)]]),  # per sample, honoured per sample
    ],
)
def test_img_shapes_forms(form, batch, tokens, expected):
    assert normalize_img_shapes(form, batch, tokens) == expected


@pytest.mark.parametrize(
    "form, batch, tokens, match",
    [
        ([(1, 3, 4)] * 3, 2, 12, "fits neither reading"),  # 3 triples for 2 samples, 36 tokens together
        ([(1, 3, 4), (1, 2, 2)], 2, 12, "fits neither reading"),
        ([[(1, 3, 4)]] * 3, 2, 12, "one list of \\(f, h, w\\) per sample"),
        ([[(1, 3, 4)], [(1, 4, 3)]], 4, 12, "one list of \\(f, h, w\\) per sample"),  # differing, not B
        ([(1, 0, 4)], 1, 0, "positive integer sizes"),
        ([(True, 3, 4)], 1, 12, "positive integer sizes"),
        ([[(1, 3, 4)]] * 2, 2, 13, "describe 12 tokens but hidden_states has 13"),
        (None, 1, 12, "img_shapes is required"),
    ],
)
def test_img_shapes_refused(form, batch, tokens, match):
    with pytest.raises(ValueError, match=match):
        normalize_img_shapes(form, batch, tokens)


def test_flat_per_sample_form_runs_like_diffusers(tiny_ckpt, ours):
    """``[(1, h, w)] * B`` (the form in the issue) runs, and equals the nested form byte for byte."""
    ref_model = tiny_ckpt[1]
    inputs = make_inputs(3, (6, 10), [5, 9, 7], seed=2, sigma=[0.8, 0.4, 0.1])
    flat = dict(inputs, img_shapes=[(1, 6, 10)] * 3)
    for runtime in ("off", "strict"):
        ours.set_runtime(runtime)
        assert_bytes_equal(_out(ours, flat), _out(ours, inputs), f"{runtime}: flat vs nested img_shapes")
    ours.set_runtime("off")
    with torch.no_grad():
        expected = ref_model(**flat).sample
    ok, max_abs, _ = tolerance("model", "production_vs_diffusers", "fp32").check(_out(ours, flat), expected)
    assert ok, f"flat img_shapes vs diffusers: max abs {max_abs:.3e}"


# ------------------------------------------------------------------------------------ loading / outputs
def test_torch_dtype_and_alias(tiny_ckpt):
    path = tiny_ckpt[0]
    a = MMDiT.from_pretrained(path, torch_dtype=torch.bfloat16)
    b = MMDiT.from_pretrained(path, dtype=torch.bfloat16)
    c = MMDiT.from_pretrained(path, torch_dtype="bfloat16", dtype=torch.bfloat16)
    assert a.dtype == b.dtype == c.dtype == torch.bfloat16
    for k, v in a.state_dict().items():
        assert_bytes_equal(v, b.state_dict()[k], f"torch_dtype vs dtype: {k}")
    with pytest.raises(ValueError, match="torch_dtype=torch.bfloat16 and dtype=torch.float32 disagree"):
        MMDiT.from_pretrained(path, torch_dtype=torch.bfloat16, dtype=torch.float32)
    with pytest.raises(ValueError, match="float32 or torch.bfloat16"):
        MMDiT.from_pretrained(path, torch_dtype=torch.float16)
    with pytest.raises(ValueError, match="not a torch dtype"):
        MMDiT.from_pretrained(path, torch_dtype="fp99")
    assert MMDiT.from_pretrained(path, torch_dtype="auto").dtype == torch.float32  # stored in FP32
    with pytest.raises(ValueError, match="'auto' needs a checkpoint"):
        MMDiT.from_config(path, torch_dtype="auto")


def test_torch_dtype_auto_reads_the_stored_dtype(tiny_ckpt, tmp_path):
    MMDiT.from_pretrained(tiny_ckpt[0], torch_dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = MMDiT.from_pretrained(tmp_path / "bf16", torch_dtype="auto")
    assert model.dtype == torch.bfloat16


def test_from_config_forms(tiny_ckpt):
    path = tiny_ckpt[0]
    from_folder = MMDiT.from_config(path, seed=3)
    from_arch = MMDiT.from_config(preset("tiny"), seed=3)
    from_dict = MMDiT.from_config(from_folder.config.to_diffusers_config(), seed=3, torch_dtype=torch.bfloat16)
    assert from_folder.config == from_arch.config == from_dict.config
    assert from_dict.dtype == torch.bfloat16
    for k, v in from_folder.state_dict().items():
        assert_bytes_equal(v, from_arch.state_dict()[k], f"from_config(folder) vs from_config(arch): {k}")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        MMDiT.from_config(path.parent / "nowhere")


def test_output_to_tuple_and_config_flags(ours):
    inputs = make_inputs(1, (2, 2), [3])
    out = ours(**inputs)
    (t,) = out.to_tuple()
    assert t is out.sample and out[0] is out.sample
    assert ours.config.guidance_embeds is False and ours.config.get("in_channels") == 64
    assert ours.config.get("no_such_key", 7) == 7
    with ours.cache_context("cond"):
        assert_bytes_equal(ours(**inputs, return_dict=False)[0], out.sample, "inside cache_context")


def test_attention_kwargs(ours):
    inputs = make_inputs(1, (2, 2), [3])
    base = _out(ours, inputs)
    for ok in (None, {}, {"scale": 1.0}):
        assert_bytes_equal(_out(ours, inputs, attention_kwargs=ok), base, f"attention_kwargs={ok}")
    with pytest.raises(ValueError, match=r"unsupported attention_kwargs \['scale'\].*set_adapters"):
        _out(ours, inputs, attention_kwargs={"scale": 0.5})
    with pytest.raises(ValueError, match=r"unsupported attention_kwargs \['ip_adapter_masks'\]"):
        _out(ours, inputs, attention_kwargs={"ip_adapter_masks": None})
    with pytest.raises(ValueError, match="attention is chosen by the runtime"):
        ours.set_attention_backend("flash")
    with pytest.raises(ValueError, match="attention processors are not supported"):
        ours.set_attn_processor(None)


def test_gradient_checkpointing_switches(tiny_ckpt):
    m = MMDiT.from_pretrained(tiny_ckpt[0])
    m.enable_gradient_checkpointing()
    assert m.is_gradient_checkpointing
    m.disable_gradient_checkpointing()
    assert not m.is_gradient_checkpointing


# ------------------------------------------------------------------------------------ LoRA
@pytest.fixture()
def lora_pair(tiny_ckpt, tmp_path):
    """diffusers' transformer with a random LoRA saved by ``save_lora_adapter``, and our model."""
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig

    ref = QwenImageTransformer2DModel.from_pretrained(str(tiny_ckpt[0]))
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v", "add_k_proj", "img_mlp.net.2"], init_lora_weights=False)
    torch.manual_seed(11)
    ref.add_adapter(cfg, adapter_name="style")
    ref.save_lora_adapter(str(tmp_path / "style"), adapter_name="style")
    return ref.eval(), MMDiT.from_pretrained(tiny_ckpt[0]), tmp_path / "style"


def test_load_lora_adapter_matches_diffusers(lora_pair):
    ref, model, folder = lora_pair
    model.load_lora_adapter(str(folder), adapter_name="style")
    assert model.active_adapters == ["style"]
    inputs = make_inputs(2, (4, 4), [5, 8], pad_to=9, seed=4, sigma=[0.7, 0.2])
    tol = tolerance("model", "production_vs_diffusers", "fp32")
    steps = [("loaded", lambda m: None), ("weight 0.5", lambda m: m.set_adapters(["style"], [0.5])),
             ("disabled", lambda m: m.disable_lora())]
    for what, act in steps:
        act(ref)
        act(model)
        with torch.no_grad():
            expected = ref(**inputs).sample
        for runtime in ("off", "strict"):
            model.set_runtime(runtime)
            got = _out(model, inputs)
            limit = tol if runtime == "off" else tolerance("model", "strict_vs_diffusers", "fp32")
            ok, max_abs, _ = limit.check(got, expected)
            assert ok, f"LoRA {what} [{runtime}] vs diffusers: max abs {max_abs:.3e}"
        model.set_runtime("off")
    disabled = _out(model, inputs)
    model.enable_lora()
    model.set_adapters("style", 1.0)
    assert not torch.equal(_out(model, inputs), disabled), "enable_lora() did not bring the adapter back"


def test_lora_state_dict_with_prefix_and_inferred_config(lora_pair, tmp_path):
    """A bare state dict under the pipeline's ``transformer.`` prefix, no saved config: rank inferred."""
    from safetensors.torch import load_file

    ref, model, folder = lora_pair
    state = {f"transformer.{k}": v for k, v in load_file(str(folder / "pytorch_lora_weights.safetensors")).items()}
    model.load_lora_adapter(state)  # alpha unknown → alpha = r (scale 1), diffusers' default
    ref.set_adapters(["style"], [4 / 8])  # same effective scale on the diffusers side (alpha 8, r 4 → 2)
    inputs = make_inputs(1, (4, 4), [6], seed=5)
    with torch.no_grad():
        expected = ref(**inputs).sample
    ok, max_abs, _ = tolerance("model", "production_vs_diffusers", "fp32").check(_out(model, inputs), expected)
    assert ok, f"inferred-config LoRA vs diffusers: max abs {max_abs:.3e}"
    assert model.adapter_names() == ["default_0"]
    out = model.save_lora_adapter(tmp_path / "again", adapter_name="default_0")
    model.delete_adapters("default_0")
    assert model.adapter_names() == []
    model.load_lora_adapter(str(out.parent), adapter_name="back")
    ok, max_abs, _ = tolerance("model", "production_vs_diffusers", "fp32").check(_out(model, inputs), expected)
    assert ok, f"LoRA saved by save_lora_adapter and reloaded: max abs {max_abs:.3e}"


def test_lora_errors(lora_pair):
    _, model, folder = lora_pair
    with pytest.raises(ValueError, match="hotswap"):
        model.load_lora_adapter(str(folder), hotswap=True)
    with pytest.raises(FileNotFoundError, match="no LoRA file"):
        model.load_lora_adapter(str(folder / "missing"))
    with pytest.raises(ValueError, match="not LoRA tensors"):
        model.load_lora_adapter({"transformer_blocks.0.attn.to_q.weight": torch.zeros(1)})
    model.load_lora_adapter(str(folder), adapter_name="a")
    with pytest.raises(ValueError, match="already exists"):
        model.load_lora_adapter(str(folder), adapter_name="a")
    with pytest.raises(ValueError, match="unknown adapters"):
        model.set_adapters(["b"])
    with pytest.raises(ValueError, match="fuse_lora is not supported"):
        model.fuse_lora()
    with pytest.raises(ValueError, match="2 adapter names but 1 weights"):
        model.set_adapters(["a", "a"], [1.0])


def test_one_prompt_broadcast_over_the_batch(ours):
    """A (1, L, C) prompt with a (1, L) mask serves every sample, as in diffusers (a single negative prompt)."""
    inputs = make_inputs(3, (2, 3), [4, 4, 4], pad_to=6, seed=9, sigma=[0.9, 0.5, 0.1])
    one = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"][:1],
               encoder_hidden_states_mask=inputs["encoder_hidden_states_mask"][:1])
    full = dict(inputs, encoder_hidden_states=one["encoder_hidden_states"].expand(3, -1, -1),
                encoder_hidden_states_mask=one["encoder_hidden_states_mask"].expand(3, -1))
    for runtime in ("off", "strict"):
        ours.set_runtime(runtime)
        assert_bytes_equal(_out(ours, one), _out(ours, full), f"{runtime}: broadcast prompt")
    ours.set_runtime("off")


def test_two_adapters_with_weights_match_diffusers(tiny_ckpt, tmp_path):
    """Two adapters active at once with per-adapter weights (runtime off; strict takes one per layer)."""
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig

    ref = QwenImageTransformer2DModel.from_pretrained(str(tiny_ckpt[0])).eval()
    model = MMDiT.from_pretrained(tiny_ckpt[0])
    for i, (name, targets) in enumerate((("a", ["to_q", "to_k"]), ("b", ["to_q", "img_mlp.net.2"]))):
        torch.manual_seed(20 + i)
        ref.add_adapter(LoraConfig(r=2 + i, lora_alpha=4, target_modules=targets, init_lora_weights=False), adapter_name=name)
        ref.save_lora_adapter(str(tmp_path / name), adapter_name=name)
        model.load_lora_adapter(str(tmp_path / name), adapter_name=name)
    ref.set_adapters(["a", "b"], [0.7, 0.4])
    model.set_adapters(["a", "b"], [0.7, 0.4])
    assert sorted(model.active_adapters) == ["a", "b"]
    inputs = make_inputs(2, (3, 3), [4, 6], seed=6, sigma=[0.6, 0.3])
    with torch.no_grad():
        expected = ref(**inputs).sample
    ok, max_abs, _ = tolerance("model", "production_vs_diffusers", "fp32").check(_out(model, inputs), expected)
    assert ok, f"two weighted adapters vs diffusers: max abs {max_abs:.3e}"
