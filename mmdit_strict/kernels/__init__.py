"""Operators: registry, trace, runtime modes and their backends (production, CPU strict, Triton)."""

from .execution import ExecutionContext, current, execution, using
from .registry import OPERATORS, KernelImpl, NoStrictKernelError, dispatch, implementations, register, resolve
from .runtime import Runtime, current_runtime, runtime_mode, strict_math
from .trace import OperatorTrace, capture_trace

__all__ = [
    "ExecutionContext", "current", "execution", "using",
    "OPERATORS", "KernelImpl", "NoStrictKernelError", "dispatch", "implementations", "register", "resolve",
    "Runtime", "current_runtime", "runtime_mode", "strict_math", "OperatorTrace", "capture_trace",
]
