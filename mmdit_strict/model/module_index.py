"""A model's modules, parameters and LoRA layers, walked once and reused while its module tree is unchanged.

The CUDA-graph paths of the forward read on every call which parameters train and each LoRA layer's adapter
state (both enter the graph keys). ``nn.Module.modules()`` over Qwen-Image with a Flow-GRPO LoRA walks 8,052
modules, building their names and calling a ``getattr`` that raises on most of them: about 20 ms of host time
on a 2-core CPU before the replay can launch, with the GPU idle. Here the walk is kept per root module and
done again when either

* a module, parameter or buffer was registered anywhere in the process since (PyTorch's global registration
  hooks see ``setattr``, ``add_module``, ``ModuleDict`` / ``ParameterDict`` items, and so PEFT injecting or
  unloading adapter layers), or
* a kept module's number of children or parameters changed (a deletion, which no hook reports: PEFT's
  ``delete_adapter``).

Writing into a module's ``_modules`` / ``_parameters`` dict directly, replacing an entry, or giving a module a
new such dict without first removing an entry from the old one goes unseen (PyTorch's containers remove first;
nothing here writes those dicts). What the kept objects hold (``requires_grad``, the adapters' active set and
scalings) is read fresh on every call. A copy of a model (``copy.deepcopy``) is another root: its own walk.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as _module

_registrations = 0  # registrations seen in this process (module, parameter or buffer)


def _registered(*_: object) -> None:
    global _registrations
    _registrations += 1


_module.register_module_module_registration_hook(_registered)
_module.register_module_parameter_registration_hook(_registered)
_module.register_module_buffer_registration_hook(_registered)


@dataclass(frozen=True)
class ModuleIndex:
    """One walk of a module tree, in ``nn.Module.modules()`` / ``parameters()`` order (pre-order, each object once).

    The root itself is not held (the index lives in a map keyed weakly by the root, so holding it would keep
    every model alive): ``below`` starts with the root's first child."""

    below: tuple[nn.Module, ...]
    parameters: tuple[nn.Parameter, ...]
    adapted_below: tuple[nn.Module, ...]  # PEFT-style adapter layers: an ``active_adapters`` and a ``scaling``
    root_adapted: bool
    registrations: int
    tables: tuple[dict, ...]  # the root's and every kept module's children and parameters dicts
    sizes: int

    def current(self) -> bool:
        """Whether the tree still is the one walked (see the module docstring for what is noticed)."""
        return self.registrations == _registrations and self.sizes == sum(map(len, self.tables))


def _adapted(m: nn.Module) -> bool:
    return getattr(m, "active_adapters", None) is not None and hasattr(m, "scaling")


def _walk(root: nn.Module) -> ModuleIndex:
    seen: set[int] = {id(root)}
    below: list[nn.Module] = []
    stack = [c for c in reversed(root._modules.values()) if c is not None]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        below.append(m)
        stack.extend(c for c in reversed(m._modules.values()) if c is not None)
    params: list[nn.Parameter] = []
    seen_p: set[int] = set()
    for m in [root, *below]:
        for p in m._parameters.values():
            if p is not None and id(p) not in seen_p:
                seen_p.add(id(p))
                params.append(p)
    tables = tuple(t for m in [root, *below] for t in (m._modules, m._parameters))
    return ModuleIndex(tuple(below), tuple(params), tuple(m for m in below if _adapted(m)), _adapted(root),
                       _registrations, tables, sum(map(len, tables)))


_INDEX: weakref.WeakKeyDictionary[nn.Module, ModuleIndex] = weakref.WeakKeyDictionary()


def module_index(root: nn.Module) -> ModuleIndex:
    """``root``'s tree, walked now or kept from an earlier call while it is unchanged."""
    index = _INDEX.get(root)
    if index is None or not index.current():
        index = _INDEX[root] = _walk(root)
    return index


def adapter_layers(root: nn.Module) -> tuple[nn.Module, ...]:
    """The PEFT-style adapter layers of ``root``'s tree (modules with ``active_adapters`` and ``scaling``), in order."""
    index = module_index(root)
    return ((root,) if index.root_adapted else ()) + index.adapted_below


def trainable_parameters(root: nn.Module) -> list[torch.Tensor]:
    """``[p for p in root.parameters() if p.requires_grad]``, from the kept walk."""
    return [p for p in module_index(root).parameters if p.requires_grad]
