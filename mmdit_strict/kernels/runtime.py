"""Runtime modes and the strict-math guards (docs/design.md §4).

The runtime mode is a field of the execution context (:mod:`.execution`, where these names are
defined); :func:`runtime_mode` enters the context in force with another mode. Library code never
flips module globals.
"""

from __future__ import annotations

from .execution import Runtime, current_runtime, runtime_mode, strict_math, tf32_state

__all__ = ["Runtime", "current_runtime", "runtime_mode", "strict_math", "tf32_state"]
