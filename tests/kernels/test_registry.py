"""The registry's declared kernel properties: what a registration states is what the trace reports."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmdit_strict.kernels import registry
from mmdit_strict.kernels.registry import KernelImpl


def _impl(**over) -> KernelImpl:
    base = dict(op="qk_rmsnorm", backend="test_backend", device="cpu", dtypes=frozenset({torch.float32}),
                fn=lambda *a, **k: None, strict=True, kernel_name="k", split_k=False)
    base.update(over)
    return KernelImpl(**base)


def test_every_strict_registration_declares_no_split_k() -> None:
    """Each strict implementation carries its own ``split_k=False`` declaration, and the trace identity
    reports the declared field (not a value derived from ``strict``)."""
    impls = registry.implementations()
    strict = [i for i in impls if i.strict]
    assert strict, "no strict implementation is registered"
    undeclared = [f"{i.op}/{i.backend}/{i.device}: split_k={i.split_k!r}" for i in strict if i.split_k is not False]
    assert not undeclared, "strict implementations that do not declare split_k=False:\n" + "\n".join(undeclared)
    for i in impls:
        assert i.identity()["split_k"] is i.split_k, f"{i.op}/{i.backend}: identity() does not report the declared split_k"


def test_production_registrations_do_not_claim_unsplit_reductions() -> None:
    """Library kernels (cuBLAS/MKL, SDPA) choose their own reduction split: the production path declares nothing."""
    prod = [i for i in registry.implementations() if i.backend == "torch"]
    assert prod, "no production implementation is registered"
    assert all(i.split_k is None for i in prod), [(i.op, i.device, i.split_k) for i in prod if i.split_k is not None]


@pytest.mark.parametrize("split_k", [None, True])
def test_register_refuses_a_strict_implementation_that_may_split(split_k) -> None:
    with pytest.raises(ValueError, match="must declare split_k=False"):
        registry.register(_impl(split_k=split_k))
    assert all(i.backend != "test_backend" for i in registry.implementations("qk_rmsnorm"))


def test_identity_reports_the_declared_field() -> None:
    """A non-strict registration that declares an unsplit reduction is reported as declared."""
    impl = _impl(strict=False, split_k=False)
    assert impl.identity()["split_k"] is False and impl.identity()["strict"] is False
    assert dataclasses.replace(impl, split_k=True).identity()["split_k"] is True


def test_source_hash_is_the_hash_of_each_objects_own_source() -> None:
    """Functions made and dropped one after another (each at an address a freed one may have had) each get
    the hash of their own source, never a cached hash of an earlier object."""
    import hashlib
    import linecache

    wrong = []
    for i in range(50):
        src = f"def f(x):\n    return x + {i}\n"
        name = f"<test_source_hash {i}>"
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        ns: dict = {}
        exec(compile(src, name, "exec"), ns)
        if registry._source_hash(ns.pop("f")) != hashlib.sha256(src.encode()).hexdigest()[:16]:
            wrong.append(i)
        del linecache.cache[name]
    assert not wrong, f"functions {wrong} got another object's source hash"
    unhashable = type("Unhashable", (), {"__eq__": lambda self, other: self is other, "__hash__": None})()
    assert registry._source_hash(unhashable) == hashlib.sha256(repr(unhashable).encode()).hexdigest()[:16]
