"""Operator registry: (operator, device type, dtype) → qualified implementation.

Each operator module registers its implementations at import time with :func:`register`. Model
code calls :func:`dispatch`, which resolves the implementation for the active runtime mode,
records the choice in the active trace, and calls it. Strict mode fails closed: a missing strict
implementation raises :class:`NoStrictKernelError`; ``auto`` falls back to the production
implementation and records the fallback.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..dtypes import SHORT_NAMES

from . import platform
from .runtime import Runtime, current_runtime
from .trace import record

# docs/design.md §5: the operator inventory. Every registered op must be one of these.
OPERATORS: tuple[str, ...] = (
    "latent_pack_unpack",
    "latent_normalize",
    "latent_proj_gemm",
    "txt_in_rmsnorm_linear",
    "timestep_embed_mlp",
    "adaln_mod_projection",
    "adaln_modulation",
    "adaln_gate_residual",
    "qkv_bias_gemm",
    "qk_rmsnorm",
    "multi_axis_rope",
    "joint_attn_qk_gemm",
    "joint_attn_softmax",
    "joint_attn_av_gemm",
    "joint_attention_fused",
    "attn_out_bias_gemm",
    "mlp_up_gemm_gelu",
    "mlp_down_gemm",
    "final_adaln_out",
    "cfg_combine_renorm",
    "flow_sigma_table",
    "flow_sde_step_logp",
    "flow_euler_step",  # the deterministic (ODE) step of rollouts with sampler.sde=false and of the strict pipeline
)

DTYPE_NAMES = SHORT_NAMES  # the package's one dtype-name map (mmdit_strict/dtypes.py)


class NoStrictKernelError(RuntimeError):
    """Strict mode asked for an operator that has no qualified implementation here."""


@dataclass(frozen=True)
class KernelImpl:
    """One implementation of one operator.

    Attributes:
        op: operator name from :data:`OPERATORS`.
        backend: ``cpu_strict`` | ``triton`` | ``torch`` (production) | ``cuda_ext``.
        device: torch device type it runs on (``cpu`` or ``cuda``).
        dtypes: execution dtypes it is qualified for.
        fn: the callable; all implementations of one op share a signature.
        strict: qualified for strict mode (batch-invariant, fixed reduction order).
        kernel_name: name of the kernel(s) launched.
        source: the module (or tuple of modules) whose source is hashed into the kernel identity.
        config: static launch configuration (tile sizes, warps); never depends on batch or tokens.
        reduction_order: the documented reduction tree, one line.
        accumulator: accumulator dtype.
        split_k: whether a reduction of this implementation may be split into partial sums that are
            combined in an order set at run time (split-K / split-KV, atomics). ``False``: declared
            unsplit — every output element is reduced by one chain in a fixed order. ``None``: not
            declared (a library kernel chooses, e.g. cuBLAS may split K). Strict implementations must
            declare ``False``; :func:`register` refuses anything else.
    """

    op: str
    backend: str
    device: str
    dtypes: frozenset
    fn: Callable[..., Any]
    strict: bool
    kernel_name: str
    source: Any = None
    config: dict = field(default_factory=dict)
    reduction_order: str = ""
    accumulator: str = "fp32"
    # fused kernels this implementation offers with the *next* operator of the graph: {next op: fn(...)}.
    # Each must give the bytes of the unfused pair; the model uses it when both ops resolve to this backend.
    fusions: dict = field(default_factory=dict)
    split_k: bool | None = None

    @property
    def source_hash(self) -> str:
        return _source_hash(self.source if self.source is not None else self.fn)

    def identity(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "backend": self.backend,
            "device": self.device,
            "kernel": self.kernel_name,
            "source_sha256": self.source_hash,
            "config": dict(self.config),
            "reduction_order": self.reduction_order,
            "accumulator": self.accumulator,
            "split_k": self.split_k,
            "strict": self.strict,
        }


def _hash_of_source(obj: Any) -> str:
    parts = []
    for part in obj if isinstance(obj, tuple) else (obj,):  # a tuple: the modules of one engine
        try:
            parts.append(inspect.getsource(part))
        except (OSError, TypeError):
            parts.append(repr(part))
    return hashlib.sha256("".join(parts).encode()).hexdigest()[:16]


# Keyed by the object itself, which the cache keeps alive: an id() key would hand a freed object's hash
# to the next object allocated at its address.
_cached_hash_of_source = functools.cache(_hash_of_source)


def _source_hash(obj: Any) -> str:
    try:
        return _cached_hash_of_source(obj)
    except TypeError:  # an unhashable callable: hashed at every call
        return _hash_of_source(obj)


_REGISTRY: dict[tuple[str, str, str], list[KernelImpl]] = {}
# resolve() results per (op, device type, dtype name, runtime); cleared whenever an implementation registers
_RESOLVED: dict[tuple[str, str, str, "Runtime"], tuple[KernelImpl, bool]] = {}
# dispatch_in()'s per-call lookup keyed on its raw (op, device, dtype, runtime) arguments; cleared with _RESOLVED
_DISPATCH: dict[tuple, tuple[KernelImpl, bool, str]] = {}
_LOADED = False


def register(impl: KernelImpl) -> KernelImpl:
    """Add an implementation; registering the same (op, backend, device) twice replaces it."""
    if impl.op not in OPERATORS:
        raise ValueError(f"unknown operator {impl.op!r}; the inventory is {OPERATORS}")
    if impl.strict and impl.split_k is not False:
        # fail closed: a strict implementation states that no reduction is split (split_k=False)
        raise ValueError(f"strict implementation {impl.op}/{impl.backend}/{impl.device} must declare split_k=False, "
                         f"got split_k={impl.split_k!r}")
    for dt in impl.dtypes:
        slot = _REGISTRY.setdefault((impl.op, impl.device, DTYPE_NAMES.get(dt, str(dt))), [])
        slot[:] = [i for i in slot if i.backend != impl.backend]
        slot.append(impl)
    _RESOLVED.clear()
    _DISPATCH.clear()
    return impl


def implementations(op: str | None = None) -> list[KernelImpl]:
    """Every registered implementation (of ``op`` if given), deduplicated."""
    _ensure_loaded()
    seen: dict[int, KernelImpl] = {}
    for (o, _, _), impls in _REGISTRY.items():
        if op is None or o == op:
            for i in impls:
                seen[id(i)] = i
    return list(seen.values())


def _ensure_loaded() -> None:
    # Importing the backends registers them; done lazily to keep import cycles out.
    global _LOADED
    if not _LOADED:
        from . import backends  # noqa: F401

        _LOADED = True


def resolve(op: str, device: torch.device | str, dtype: torch.dtype, runtime: Runtime | None = None) -> tuple[KernelImpl, bool]:
    """Pick the implementation for ``op`` on ``device``/``dtype`` under ``runtime``.

    Returns ``(impl, fell_back)``. Raises :class:`NoStrictKernelError` in strict/audit mode when no
    strict implementation is qualified for the combination.
    """
    _ensure_loaded()
    runtime = runtime or current_runtime()
    dev = device.type if isinstance(device, torch.device) else torch.device(device).type
    dname = DTYPE_NAMES.get(dtype, str(dtype))
    key = (op, dev, dname, runtime)
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    hit = _resolve_uncached(op, dev, dname, runtime)
    _RESOLVED[key] = hit
    return hit


def _resolve_uncached(op: str, dev: str, dname: str, runtime: Runtime) -> tuple[KernelImpl, bool]:
    impls = _REGISTRY.get((op, dev, dname), [])
    strict_impls = [i for i in impls if i.strict]
    refused: list[str] = []
    if dev == "cuda" and runtime is not Runtime.OFF:  # strict kernels run only on the GPUs they were qualified on
        gpu = platform.cuda_platform()
        reasons = [(i, platform.unqualified_reason(i.backend, gpu)) for i in strict_impls]
        refused = sorted({r for _, r in reasons if r})
        strict_impls = [i for i, r in reasons if r is None]
    prod = [i for i in impls if not i.strict]
    if runtime is Runtime.OFF:
        if prod:
            return prod[0], False
        raise RuntimeError(f"operator {op} has no production implementation for device={dev} dtype={dname}")
    if strict_impls:
        # Prefer compiled kernels over the CPU strict backend when both are registered for a device.
        order = {"triton": 0, "cuda_ext": 1, "cpu_strict": 2, "torch_fixed": 3}
        return sorted(strict_impls, key=lambda i: order.get(i.backend, 9))[0], False
    if runtime is Runtime.AUTO and prod:
        return prod[0], True
    qualified = sorted({(i_dev, i_dt) for (o, i_dev, i_dt), v in _REGISTRY.items() if o == op and any(i.strict for i in v)})
    why = f" on this GPU: {'; '.join(refused)}" if refused else ""
    raise NoStrictKernelError(
        f"strict mode: operator {op!r} has no qualified strict kernel for device={dev} dtype={dname}{why} "
        f"(registered: {', '.join(f'{d}/{t}' for d, t in qualified) or 'none'}). "
        "Use runtime=auto to fall back (recorded in the trace) or runtime=off for the production path."
    )


def dispatch(op: str, device: torch.device | str, dtype: torch.dtype, *args: Any, **kwargs: Any) -> Any:
    """Resolve ``op`` for the active runtime, record it in the active trace, and call it."""
    return dispatch_in(current_runtime(), op, device, dtype, *args, **kwargs)


def dispatch_in(runtime: Runtime, op: str, device: torch.device | str, dtype: torch.dtype, *args: Any, **kwargs: Any) -> Any:
    """:func:`dispatch` under ``runtime`` whatever mode is active (the production forward passes ``Runtime.OFF``)."""
    key = (op, device, dtype, runtime)
    hit = _DISPATCH.get(key)
    if hit is None:
        impl, fell_back = resolve(op, device, dtype, runtime)
        hit = (impl, fell_back, device.type if isinstance(device, torch.device) else torch.device(device).type)
        _DISPATCH[key] = hit
    impl, fell_back, dev = hit
    record(op, impl, runtime, dev, dtype, fell_back)
    return impl.fn(*args, **kwargs)
