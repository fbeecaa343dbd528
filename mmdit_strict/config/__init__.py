"""Typed configuration: architecture presets and hydra-style run configs."""

from .arch import PRESETS, ArchConfig, preset

__all__ = ["ArchConfig", "PRESETS", "preset"]
