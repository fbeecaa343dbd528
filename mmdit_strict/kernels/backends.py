"""Importing this module registers every backend that can load on this machine."""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

# Production (runtime=off) and CPU strict implementations are always available.
_ALWAYS = ("mmdit_strict.kernels.production", "mmdit_strict.kernels.cpu")
# Triton kernels register their CUDA slots only where Triton imports.
_OPTIONAL = ("mmdit_strict.kernels.triton",)

for _name in _ALWAYS:
    importlib.import_module(_name)

for _name in _OPTIONAL:
    try:
        importlib.import_module(_name)
    except ImportError as exc:  # no triton on this platform: the CUDA strict slots stay empty (fail closed)
        logger.info("backend %s not loaded: %s", _name, exc)
