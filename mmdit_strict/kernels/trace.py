"""Operator trace: which implementation ran for each operator, and under which arithmetic policy.

Capture with :func:`capture_trace`; the resulting :class:`OperatorTrace` dumps to JSON.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from .execution import Runtime, bind, current, tf32_state


@dataclass
class TraceRecord:
    op: str
    requested: str
    actual_backend: str
    device: str
    dtype: str
    kernel: dict[str, Any]
    fallback: bool
    policy: dict[str, Any] = field(default_factory=dict)  # arithmetic policy in force when it was dispatched
    calls: int = 0


@dataclass
class OperatorTrace:
    """Aggregated per (op, device, dtype, backend): counts plus the kernel identity and policy."""

    records: dict[tuple, TraceRecord] = field(default_factory=dict)

    def add(self, op: str, impl: Any, runtime: Runtime, device: str, dtype: torch.dtype, fell_back: bool) -> None:
        from .registry import DTYPE_NAMES

        dname = DTYPE_NAMES.get(dtype, str(dtype))
        key = (op, device, dname, impl.backend)
        rec = self.records.get(key)
        if rec is None:
            rec = TraceRecord(
                op=op,
                requested=runtime.value,
                actual_backend=impl.backend,
                device=device,
                dtype=dname,
                kernel=impl.identity(),
                fallback=fell_back,
                policy=current_policy(),
            )
            self.records[key] = rec
        rec.calls += 1

    def merge(self, other: "OperatorTrace") -> None:
        """Add ``other``'s calls (e.g. a replayed CUDA graph's recorded operators) to this trace."""
        for key, rec in other.records.items():
            mine = self.records.get(key)
            if mine is None:
                self.records[key] = TraceRecord(**{**rec.__dict__, "calls": 0})
                mine = self.records[key]
            mine.calls += rec.calls

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> "OperatorTrace":
        """Rebuild a trace from ``[vars(record), ...]`` (as a resumed run stored it)."""
        trace = cls()
        for r in records:
            rec = TraceRecord(**r)
            trace.records[(rec.op, rec.device, rec.dtype, rec.actual_backend)] = rec
        return trace

    def record_dicts(self) -> list[dict[str, Any]]:
        return [dict(vars(r)) for r in self.records.values()]

    @property
    def fallbacks(self) -> list[TraceRecord]:
        return [r for r in self.records.values() if r.fallback]

    def policy(self) -> dict[str, Any]:
        """The arithmetic policy in force while the recorded operators ran (the current one if none ran).

        Records carry the policy of their first dispatch; when records disagree, the value is the
        sorted list of distinct values seen.
        """
        seen = [r.policy for r in self.records.values() if r.policy]
        if not seen:
            return current_policy()
        merged: dict[str, Any] = {}
        for key in seen[0]:
            values = sorted({repr(p.get(key)) for p in seen})
            merged[key] = seen[0][key] if len(values) == 1 else values
        return merged

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy(),
            "fallbacks": len(self.fallbacks),
            "operators": [vars(r) for r in sorted(self.records.values(), key=lambda r: (r.op, r.device, r.dtype))],
        }

    def summary(self) -> dict[str, Any]:
        return {
            "operators": len({r.op for r in self.records.values()}),
            "calls": sum(r.calls for r in self.records.values()),
            "backends": sorted({r.actual_backend for r in self.records.values()}),
            "fallbacks": [f"{r.op}:{r.device}/{r.dtype}->{r.actual_backend}" for r in self.fallbacks],
        }

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, default=str))


def current_policy() -> dict[str, Any]:
    """TF32 switches, deterministic-algorithms flag, uninitialized-memory fill and FP32 matmul precision now."""
    return {
        **tf32_state(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "fill_uninitialized_memory": bool(torch.utils.deterministic.fill_uninitialized_memory),  # type: ignore[attr-defined]
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


@contextlib.contextmanager
def capture_trace(trace: OperatorTrace | None = None) -> Iterator[OperatorTrace]:
    """Record every dispatched operator inside the block into ``trace`` (a new one by default): the
    ``trace`` field of the execution context."""
    active = trace if trace is not None else OperatorTrace()
    with bind(current().replace(trace=active)):
        yield active


def active_trace() -> OperatorTrace | None:
    """The trace :func:`capture_trace` is recording into, if any."""
    return current().trace


def record(op: str, impl: Any, runtime: Runtime, device: str, dtype: torch.dtype, fell_back: bool) -> None:
    """Count one dispatch of ``op`` to ``impl`` in the trace of the context in force (if any)."""
    trace = current().trace
    if trace is not None:
        trace.add(op, impl, runtime, device, dtype, fell_back)
