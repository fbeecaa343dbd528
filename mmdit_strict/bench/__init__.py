"""Benchmarks and GPU qualification runners (``python -m mmdit_strict.bench.<name> --out DIR``)."""
