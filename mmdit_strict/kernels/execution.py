"""The execution context: every piece of state that decides which bytes an operator call produces.

One frozen :class:`ExecutionContext` is in force at any point of the program (context-local: threads and
tasks that copy their context see their own). Operators read it through :func:`current`; callers
enter a changed copy for a block with :func:`execution` (``with execution(runtime="strict"):``) or
a whole context with :func:`using`. Nested changes are :meth:`ExecutionContext.replace` of the one in
force, and the previous context is back after the block, also on an error.

A computation that runs later, outside the caller's block (a gradient-checkpoint recompute, a
backward), sees the forward's state by holding the context object it read at forward time and
entering it again (:func:`in_context`). docs/execution_context.md is the guide.

The runtime modes and the math policy a strict runtime pins live here too: a context's runtime is one
of its fields, and entering a context with a strict-like runtime pins that policy for the block.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from .grad_sink import SampleGradSink
    from .kept_outputs import KeptOutputs
    from .prologues import PrologueMemo
    from .trace import OperatorTrace

R = TypeVar("R")

GEMM_STREAMS = ("image", "text")

# True: strict blocks keep PyTorch's NaN fill of uninitialized tensors (a debugging poison; see strict_math).
POISON_UNINITIALIZED = False


class Runtime(str, Enum):
    """How operators are chosen.

    STRICT: only qualified batch-invariant implementations; anything else raises (fail closed).
    AUDIT:  strict results are returned; the production path also runs and its drift is recorded.
    AUTO:   strict where qualified, production fallback elsewhere, every fallback recorded.
    OFF:    plain PyTorch production path (cuBLAS / SDPA / MKL), no invariance promised.
    """

    STRICT = "strict"
    AUDIT = "audit"
    AUTO = "auto"
    OFF = "off"

    @classmethod
    def parse(cls, value: "str | Runtime") -> "Runtime":
        """``value`` as a :class:`Runtime` (names are case-insensitive); ValueError for an unknown one."""
        if isinstance(value, Runtime):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"unknown runtime {value!r}; choose one of {[m.value for m in cls]}"
            ) from None


@dataclass(frozen=True)
class Layout:
    """Where this process sits among the processes of one run: ``rank`` of ``world`` (one process: 0 of 1)."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"layout needs 0 <= rank < world, got rank {self.rank} of {self.world}")


@dataclass(frozen=True, eq=False)
class ExecutionContext:
    """The state in force for operator calls. Immutable; change it with :meth:`replace` and enter the copy.

    Attributes:
        runtime: the runtime mode a caller chose, or None where none did (operators then run ``off``,
            and a model's forward runs in the model's default runtime).
        gemm_stream: ``"image"`` or ``"text"``: which stream of the joint model a GEMM belongs to (the
            strict model sets it around every product; the Triton engine picks that stream's tile).
        gemm_columns: the whole layer's output features N when the GEMM in force computes a column shard
            of that layer (tensor parallelism), else None: the engine then takes the whole layer's
            configuration, so every shard column gets the whole product's arithmetic.
        fault: an operator output key to perturb (``block1.img.mlp_down_gemm``), or None.
        capture: operator outputs recorded by key, or None (not capturing).
        gemm_calls: every GEMM the strict forward hands to the engine (shapes), or None.
        grad_sink: where the strict GEMM backward deposits per-sample gradient partials, or None.
        sample_keys: the sample key of each sample of the forwards run, in batch order, or None.
        trace: the operator trace dispatches record into, or None.
        keepalive: objects cached device tables passed through ``keepalive.retain`` (a CUDA graph
            capture keeps them alive), or None.
        layout: this process's rank and world size.
        overlay: the semantic perturbation applied to this side's operators (``mmdit_strict.overlay``), or None.
        parallel: the model-parallel layout this rank's forwards run under (``mmdit_strict.parallel``), or None.
        prologues: the GEMM prologue results kept for reuse within one forward (:mod:`.prologues`), or None.
        kept_outputs: during a checkpointed training forward, operator outputs kept for the recompute of the
            same call (:mod:`.kept_outputs`), or None.

    Collectors (capture, gemm_calls, grad_sink, trace, keepalive, prologues, kept_outputs) are shared by reference: a copy
    made with :meth:`replace` records into the same objects. Contexts compare by identity.
    """

    runtime: Runtime | None = None
    gemm_stream: str = "image"
    gemm_columns: int | None = None
    fault: str | None = None
    capture: dict[str, torch.Tensor] | None = None
    gemm_calls: list[Any] | None = None
    grad_sink: SampleGradSink | None = None
    sample_keys: tuple[Hashable, ...] | None = None
    trace: OperatorTrace | None = None
    keepalive: list[Any] | None = None
    layout: Layout = Layout()
    overlay: Any = None
    parallel: Any = None
    prologues: PrologueMemo | None = None
    kept_outputs: KeptOutputs | None = None
    # copies made by switched(), one per (field, value): the strict model switches streams around every product
    _switched: dict[tuple[str, Hashable], ExecutionContext] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.runtime is not None and not isinstance(self.runtime, Runtime):
            raise TypeError(f"runtime must be a Runtime or None, got {self.runtime!r} (use Runtime.parse)")
        if self.gemm_stream not in GEMM_STREAMS:
            raise ValueError(f"gemm stream must be one of {GEMM_STREAMS}, got {self.gemm_stream!r}")
        if self.sample_keys is not None and not isinstance(self.sample_keys, tuple):
            raise TypeError(f"sample_keys must be a tuple or None, got {type(self.sample_keys).__name__}")

    def replace(self, **changes: Any) -> "ExecutionContext":
        """A copy with ``changes`` applied (``dataclasses.replace``; checked like a new context)."""
        return dataclasses.replace(self, **changes)

    def switched(self, name: str, value: Hashable) -> "ExecutionContext":
        """This context with field ``name`` set to ``value``: ``self`` when it already holds it, else a copy
        made once per (context, field, value) and reused. For small immutable switches (a GEMM stream), not
        for collectors: the copy lives as long as this context."""
        if getattr(self, name) == value:
            return self
        key = (name, value)
        other = self._switched.get(key)
        if other is None:
            other = self._switched[key] = self.replace(**{name: value})
        return other

    @property
    def pins_strict_math(self) -> bool:
        """True when entering this context pins the strict math policy (a runtime other than ``off``)."""
        return self.runtime is not None and self.runtime is not Runtime.OFF


_CURRENT: contextvars.ContextVar[ExecutionContext] = contextvars.ContextVar(
    "mmdit_execution_context", default=ExecutionContext())


def current() -> ExecutionContext:
    """The execution context in force."""
    return _CURRENT.get()


def current_runtime() -> Runtime:
    """The runtime mode of the context in force (``off`` where no caller chose one)."""
    runtime = _CURRENT.get().runtime
    return Runtime.OFF if runtime is None else runtime


class bind:
    """Context manager: ``ctx`` is the context in force inside the block, the previous one after it.

    Sets the context and nothing else (no math policy): for nested changes of a context already
    entered with :func:`using`. One instance per ``with``.
    """

    __slots__ = ("ctx", "_token")

    def __init__(self, ctx: ExecutionContext) -> None:
        self.ctx = ctx

    def __enter__(self) -> ExecutionContext:
        self._token = _CURRENT.set(self.ctx)
        return self.ctx

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._token)


class switch:
    """Context manager: the context in force at entry, :meth:`~ExecutionContext.switched` to ``value`` in
    field ``name`` (nothing is set when it already holds it). The strict model binds its GEMM stream
    this way around every product; one instance per ``with``."""

    __slots__ = ("name", "value", "_token")

    def __init__(self, name: str, value: Hashable) -> None:
        self.name, self.value = name, value

    def __enter__(self) -> None:
        ctx = _CURRENT.get()
        other = ctx.switched(self.name, self.value)
        self._token = None if other is ctx else _CURRENT.set(other)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)


@contextlib.contextmanager
def strict_math() -> Iterator[None]:
    """Pin the arithmetic policy: TF32 off, deterministic algorithms on; restored on exit.

    PyTorch's deterministic mode also fills every uninitialized tensor (``torch.empty``) with NaN, one
    extra write pass per output buffer. Strict kernels write every element they return, so the block turns
    that fill off unless :data:`POISON_UNINITIALIZED` is set (a GPU test runs the model both ways and
    compares bytes, which is what proves no strict kernel reads memory it did not write).
    """
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_float32_matmul_precision(),
        torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.utils.deterministic.fill_uninitialized_memory = POISON_UNINITIALIZED  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.backends.cudnn.allow_tf32 = saved[1]
        torch.use_deterministic_algorithms(saved[2], warn_only=saved[3])
        torch.set_float32_matmul_precision(saved[4])
        torch.utils.deterministic.fill_uninitialized_memory = saved[5]  # type: ignore[attr-defined]


def tf32_state() -> dict[str, bool]:
    """The TF32 switches of CUDA matmuls and cuDNN right now."""
    return {
        "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
    }


@contextlib.contextmanager
def using(ctx: ExecutionContext) -> Iterator[ExecutionContext]:
    """Run the block in ``ctx``; a strict-like runtime (anything but ``off``) also pins :func:`strict_math`."""
    with bind(ctx):
        if ctx.pins_strict_math:
            with strict_math():
                yield ctx
        else:
            yield ctx


@contextlib.contextmanager
def execution(**changes: Any) -> Iterator[ExecutionContext]:
    """Run the block in the context in force with ``changes`` (field names of :class:`ExecutionContext`;
    ``runtime`` may be given by name), entered with :func:`using`; yields that context."""
    if isinstance(changes.get("runtime"), str):
        changes["runtime"] = Runtime.parse(changes["runtime"])
    with using(_CURRENT.get().replace(**changes)) as ctx:
        yield ctx


@contextlib.contextmanager
def runtime_mode(mode: "str | Runtime") -> Iterator[Runtime]:
    """Run the enclosed code in runtime ``mode``; strict-like modes also pin the math policy."""
    mode = Runtime.parse(mode)
    with using(_CURRENT.get().replace(runtime=mode)):
        yield mode


def in_context(fn: Callable[..., R], ctx: ExecutionContext | None = None) -> Callable[..., R]:
    """``fn`` wrapped to run in ``ctx`` (the context in force now, by default) whenever it is called later:
    how a checkpoint recompute or a deferred call sees the forward's state."""
    held = _CURRENT.get() if ctx is None else ctx

    def run(*args: Any, **kwargs: Any) -> R:
        with using(held):
            return fn(*args, **kwargs)

    return run
