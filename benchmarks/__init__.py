"""Tuning sweeps and probes of the strict kernels (GPU; not installed with the package).

Run from the repository root as ``python -m benchmarks.<name> --out DIR``. The user-facing
measurements are ``mmdit-strict bench`` and ``mmdit-strict qualify``.
"""
