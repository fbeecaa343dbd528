"""The exported LoRA loads into diffusers' QwenImageTransformer2DModel and gives our output within tolerance."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.training.conftest import compose_train
from mmdit_strict.tolerances import tolerance
from mmdit_strict.training.loop import Trainer
from tests.helpers import make_inputs
from tests.training.conftest import SMALL


@pytest.fixture(scope="module")
def trained(tiny_ckpt, tmp_path_factory):
    path, _ = tiny_ckpt
    out = tmp_path_factory.mktemp("export")
    cfg = compose_train([f"output_dir={out}", *SMALL, f"model.checkpoint={path}", "lora.init=random", "train.num_epochs=1",
                   "train.export=true", "lora.rank=3", "lora.alpha=6.0",
                   'lora.targets=["to_q","to_k","to_v","to_out.0","add_q_proj","add_k_proj","add_v_proj","to_add_out","img_mlp.net.0.proj","img_mlp.net.2","txt_mlp.net.0.proj","txt_mlp.net.2"]'])
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


@pytest.mark.slow
def test_diffusers_lora_loads_with_load_lora_adapter(trained) -> None:
    from diffusers import QwenImageTransformer2DModel

    path, ours, export = trained
    ref = QwenImageTransformer2DModel.from_pretrained(str(path)).float().eval()
    inputs = make_inputs(2, (4, 4), [5, 9], seed=3, sigma=[0.8, 0.3])
    with torch.no_grad():
        base = ref(**inputs).sample
    ref.load_lora_adapter(str(export["diffusers"]), weight_name="pytorch_lora_weights.safetensors", prefix="transformer")
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
    inputs = make_inputs(1, (4, 6), [7], seed=4, sigma=0.55)
    with torch.no_grad():
        got = model(**inputs).sample
    _check(got, _ours(ours, inputs), "PEFT-loaded adapter vs ours")
