"""The kept walk of a model's tree (``model/module_index.py``): PyTorch's order, reused while the tree is unchanged,
walked again after any change PyTorch or PEFT makes, and never kept across a forward's own work."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from torch import nn

from mmdit_strict import MMDiT
from mmdit_strict.model.graphs import adapter_state
from mmdit_strict.model.module_index import adapter_layers, module_index, trainable_parameters
from tests.helpers import make_inputs


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _lora_model(tiny_ckpt) -> MMDiT:
    model = MMDiT.from_pretrained(tiny_ckpt[0], runtime="strict")
    inject_adapter_in_model(PeftLoraConfig(r=2, lora_alpha=4.0, target_modules=["to_q", "img_mlp.net.2"]), model)
    return model


def test_the_walk_is_pytorchs_order_and_kept_while_nothing_changes(tiny_ckpt) -> None:
    model = _lora_model(tiny_ckpt)
    shared = nn.Linear(2, 2)
    model.extra_a, model.extra_b = shared, shared  # one module twice: listed once, as modules() does
    index = module_index(model)
    assert _same((model, *index.below), list(model.modules()))
    assert _same(index.parameters, list(model.parameters()))
    assert _same(adapter_layers(model), [m for m in model.modules() if hasattr(m, "lora_A")])
    assert module_index(model) is index
    model.requires_grad_(False)
    model.transformer_blocks[0].attn.to_q.lora_A["default"].weight.requires_grad_(True)  # read fresh on every call
    assert _same(trainable_parameters(model), [p for p in model.parameters() if p.requires_grad])
    assert module_index(model) is index


def test_a_strict_forward_and_backward_register_nothing(tiny_ckpt) -> None:
    model = _lora_model(tiny_ckpt)
    model.enable_gradient_checkpointing(True)
    index = module_index(model)
    model(**make_inputs(2, (4, 4), [5, 3])).sample.square().sum().backward()
    assert module_index(model) is index


@pytest.mark.parametrize("change", ["inject", "setattr", "delattr", "delete_adapter", "parameter", "deepcopy"])
def test_every_change_of_the_tree_is_walked_again(tiny_ckpt, change: str) -> None:
    model = _lora_model(tiny_ckpt)
    before = module_index(model)
    block = model.transformer_blocks[0]
    if change == "inject":
        inject_adapter_in_model(PeftLoraConfig(r=2, target_modules=["to_k"]), model, adapter_name="other")
    elif change == "setattr":
        block.attn.to_k = nn.Linear(block.attn.to_k.in_features, block.attn.to_k.out_features)
    elif change == "delattr":
        del block.attn.to_out[1]  # a child deleted: no hook reports it
    elif change == "delete_adapter":
        block.attn.to_q.delete_adapter("default")
    elif change == "parameter":
        block.norm_probe = nn.Parameter(torch.zeros(3))
    else:
        model = copy.deepcopy(model)
    after = module_index(model)
    assert after is not before
    assert _same((model, *after.below), list(model.modules()))
    assert _same(after.parameters, list(model.parameters()))
    assert adapter_state(model) == tuple(
        (bool(m.disable_adapters), tuple(m.active_adapters), tuple(sorted((k, float(v)) for k, v in m.scaling.items())))
        for m in model.modules() if hasattr(m, "lora_A"))


def test_the_index_keeps_no_model_alive(tiny_ckpt) -> None:
    model = _lora_model(tiny_ckpt)
    module_index(model)
    adapter_state(model)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_an_adapter_layer_as_the_root_is_listed() -> None:
    layer = nn.Sequential(nn.Linear(4, 4))
    inject_adapter_in_model(PeftLoraConfig(r=2, target_modules=["0"]), layer)
    lora = layer[0]
    assert adapter_layers(lora) == (lora,)
    assert adapter_layers(layer) == (lora,)
