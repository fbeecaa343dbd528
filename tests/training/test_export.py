"""The exported LoRA loads into diffusers' QwenImageTransformer2DModel (our output within tolerance) and into our
MMDiT (the trained LoRA bytes and output bytes); the exported files are byte-stable."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from mmdit_strict import MMDiT
from mmdit_strict.tolerances import tolerance
from mmdit_strict.training.export import export_lora, lora_tensors
from mmdit_strict.training.loop import Trainer
from tests.harness import assert_bytes_equal
from tests.helpers import make_inputs
from tests.training.conftest import SMALL, compose_train

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]


@pytest.fixture(scope="module")
def trained(tiny_ckpt, tmp_path_factory):
    path, _ = tiny_ckpt
    out = tmp_path_factory.mktemp("export")
    cfg = compose_train([f"output_dir={out}", *SMALL, f"model.checkpoint={path}", "lora.init=random", "train.num_epochs=1",
                   "train.export=true", "lora.rank=3", "lora.alpha=6.0", "lora.targets=" + json.dumps(TARGETS, separators=(",", ":"))])
    tr = Trainer(cfg, progress=False)
    res = tr.run()
    tr.model.set_runtime("off")
    return path, tr.model, res.export


def _ours(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def _check(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    ok, max_abs, _ = tolerance("training", "lora_export_vs_diffusers", "fp32").check(actual, expected)
    assert ok, f"{what}: max abs {max_abs:.3e} (max |expected| {float(expected.abs().max()):.2f})"


def _assert_same_lora(model: torch.nn.Module, adapter: str, trained: torch.nn.Module, what: str) -> None:
    """Every LoRA tensor of ``adapter`` in ``model`` has the trained adapter's bytes (same names, no extra, none missing)."""
    got, want = lora_tensors(model, adapter), lora_tensors(trained)
    assert sorted(got) == sorted(want), f"{what}: LoRA modules differ: {sorted(set(got) ^ set(want))[:4]}"
    for name in want:
        assert_bytes_equal(got[name], want[name], f"{what}: {name}")


def _assert_same_outputs(model: torch.nn.Module, trained: torch.nn.Module, what: str) -> None:
    """Same weights and runtime → the same output bytes, in the production and the strict forward."""
    inputs = make_inputs(2, (4, 4), [5, 9], seed=3, sigma=[0.8, 0.3])
    try:
        for runtime in ("off", "strict"):
            model.set_runtime(runtime)
            trained.set_runtime(runtime)
            assert_bytes_equal(_ours(model, inputs), _ours(trained, inputs), f"{what} [{runtime}]")
    finally:
        model.set_runtime("off")
        trained.set_runtime("off")


@pytest.mark.slow
def test_diffusers_lora_loads_with_load_lora_adapter(trained) -> None:
    from diffusers import QwenImageTransformer2DModel

    path, ours, export = trained
    ref = QwenImageTransformer2DModel.from_pretrained(str(path)).float().eval()
    inputs = make_inputs(2, (4, 4), [5, 9], seed=3, sigma=[0.8, 0.3])
    with torch.no_grad():
        base = ref(**inputs).sample
    ref.load_lora_adapter(str(export["diffusers"]), weight_name="pytorch_lora_weights.safetensors", prefix="transformer")
    _assert_same_lora(ref, "default_0", ours, "lora/diffusers → diffusers' load_lora_adapter")
    with torch.no_grad():
        got = ref(**inputs).sample
    want = _ours(ours, inputs)
    assert float((want - base).abs().max()) > 1e-3, "the adapter must change the output for this check to mean anything"
    _check(got, want, "diffusers + exported LoRA vs ours")


@pytest.mark.slow
def test_peft_folder_loads_with_peft(trained) -> None:
    from diffusers import QwenImageTransformer2DModel
    from peft import PeftModel

    path, ours, export = trained
    cfg = json.loads((export["peft"] / "adapter_config.json").read_text())
    assert cfg["r"] == 3 and cfg["lora_alpha"] == 6.0
    with safe_open(str(export["peft"] / "adapter_model.safetensors"), "pt") as fh:
        assert all(k.startswith("base_model.model.transformer_blocks.") for k in fh.keys())
    ref = QwenImageTransformer2DModel.from_pretrained(str(path)).float().eval()
    model = PeftModel.from_pretrained(ref, str(export["peft"]))
    _assert_same_lora(model.get_base_model(), "default", ours, "lora/peft → PeftModel.from_pretrained (diffusers)")
    inputs = make_inputs(1, (4, 6), [7], seed=4, sigma=0.55)
    with torch.no_grad():
        got = model(**inputs).sample
    _check(got, _ours(ours, inputs), "PEFT-loaded adapter vs ours")


# ------------------------------------------------------------------ round trips onto our transformer
@pytest.mark.slow
def test_diffusers_export_loads_into_our_transformer_with_load_lora_adapter(trained) -> None:
    """trust row 1: MMDiT.load_lora_adapter(lora/diffusers) failed with KeyError: 'model_type'."""
    path, ours, export = trained
    model = MMDiT.from_pretrained(path)
    model.load_lora_adapter(str(export["diffusers"]))
    assert model.adapter_names() == ["default_0"]
    with pytest.raises(ValueError, match="no target_modules"):  # the config is stored under 'transformer.'
        model.load_lora_adapter(str(export["diffusers"]), prefix=None)
    assert model.adapter_names() == ["default_0"]
    _assert_same_lora(model, "default_0", ours, "lora/diffusers → MMDiT.load_lora_adapter")
    _assert_same_outputs(model, ours, "lora/diffusers → MMDiT.load_lora_adapter")


@pytest.fixture(scope="module")
def tiny_pipeline_dir(tmp_path_factory):
    """A tiny QwenImagePipeline folder (its transformer has tiny_ckpt's architecture)."""
    from mmdit_strict.pipelines.tiny import save_tiny_pipeline

    return save_tiny_pipeline(tmp_path_factory.mktemp("pipe") / "tiny-qwen-image", seed=0)


@pytest.mark.slow
def test_diffusers_export_loads_into_a_qwen_image_pipeline_holding_our_transformer(trained, tiny_pipeline_dir) -> None:
    """trust row 1: QwenImagePipeline.load_lora_weights(lora/diffusers) with MMDiT as the pipeline's transformer."""
    from diffusers import QwenImagePipeline

    path, ours, export = trained
    pipe = QwenImagePipeline.from_pretrained(str(tiny_pipeline_dir))
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer = MMDiT.from_pretrained(path)  # the base the LoRA was trained on (same architecture as the tiny pipeline's)
    pipe.load_lora_weights(str(export["diffusers"]), adapter_name="grpo")
    assert pipe.transformer.adapter_names() == ["grpo"]
    _assert_same_lora(pipe.transformer, "grpo", ours, "lora/diffusers → pipe.load_lora_weights")
    _assert_same_outputs(pipe.transformer, ours, "lora/diffusers → pipe.load_lora_weights")
    call = dict(prompt="a red cat", negative_prompt=" ", true_cfg_scale=4.0, height=32, width=32, num_inference_steps=2,
                output_type="latent")
    loaded = pipe(generator=torch.Generator().manual_seed(0), **call).images
    pipe.transformer = ours
    assert_bytes_equal(loaded, pipe(generator=torch.Generator().manual_seed(0), **call).images,
                       "pipeline latents: loaded LoRA vs the trained model")


@pytest.mark.slow
def test_peft_export_loads_into_our_transformer_with_peft_model_from_pretrained(trained) -> None:
    """trust row 1: lora/peft through PEFT's own entry point onto MMDiT."""
    from peft import PeftModel

    path, ours, export = trained
    model = PeftModel.from_pretrained(MMDiT.from_pretrained(path), str(export["peft"]))
    inner = model.get_base_model()
    assert isinstance(inner, MMDiT)
    _assert_same_lora(inner, "default", ours, "lora/peft → PeftModel.from_pretrained")
    _assert_same_outputs(inner, ours, "lora/peft → PeftModel.from_pretrained")


@pytest.mark.slow
def test_peft_export_loads_into_our_transformer_with_load_lora_adapter(trained) -> None:
    """trust row 1: MMDiT.load_lora_adapter(lora/peft) failed (NoMatchingPeftModuleError with the PEFT weight name):
    PEFT's ``base_model.model.`` key prefix and its adapter_config.json must both be understood."""
    from safetensors.torch import load_file

    path, ours, export = trained
    for kwargs in ({"weight_name": "adapter_model.safetensors"}, {}):
        model = MMDiT.from_pretrained(path)
        model.load_lora_adapter(str(export["peft"]), **kwargs)
        _assert_same_lora(model, "default_0", ours, f"lora/peft → MMDiT.load_lora_adapter {kwargs}")
        _assert_same_outputs(model, ours, f"lora/peft → MMDiT.load_lora_adapter {kwargs}")
    # the tensors alone (what pipe.load_lora_weights forwards from this folder): alpha unknown, so refused
    with pytest.raises(ValueError, match="without their adapter_config.json"):
        MMDiT.from_pretrained(path).load_lora_adapter(load_file(str(export["peft"] / "adapter_model.safetensors")))


# ------------------------------------------------------------------ byte-stable files
@pytest.mark.slow
def test_two_exports_of_the_same_model_are_byte_identical_files(trained, tmp_path) -> None:
    """trust row 14: the safetensors library writes its metadata through a hash map, so the two-key header of the
    diffusers file came out in either order (per write, even in one process); twelve exports all matching the
    first by chance would have had odds of 1 in 4096."""
    _, ours, export = trained
    files = ["peft/adapter_model.safetensors", "peft/adapter_config.json", "diffusers/pytorch_lora_weights.safetensors"]
    first = {f: (export["peft"].parent / f).read_bytes() for f in files}  # the training run's own export
    for i in range(12):
        again = export_lora(ours, tmp_path / str(i), rank=3, alpha=6.0, targets=TARGETS)
        for f in files:
            assert (again["peft"].parent / f).read_bytes() == first[f], f"export {i}: {f} differs from the first export"


def test_save_lora_adapter_twice_gives_byte_identical_files(tiny_ckpt, tmp_path) -> None:
    """trust row 14: MMDiT.save_lora_adapter writes the same two-key safetensors header as the export."""
    from peft import LoraConfig

    model = MMDiT.from_pretrained(tiny_ckpt[0])
    model.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=["to_q", "img_mlp.net.2"], init_lora_weights=False), "x")
    first = model.save_lora_adapter(tmp_path / "0", adapter_name="x").read_bytes()
    for i in range(1, 12):
        assert model.save_lora_adapter(tmp_path / str(i), adapter_name="x").read_bytes() == first, f"save {i} differs"
