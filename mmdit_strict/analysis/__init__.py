"""Analysis tools: where and by how much the runtimes depart from each other and from the FP64 reference.

``block_error``: per-stage error curve of strict vs production vs the FP64 reference
(``python -m mmdit_strict.analysis.block_error --out DIR``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["block_error_curve", "write_block_error"]


def __getattr__(name: str) -> Any:
    # Lazy, so ``python -m mmdit_strict.analysis.block_error`` does not import the module twice.
    if name in __all__:
        from . import block_error

        return getattr(block_error, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
