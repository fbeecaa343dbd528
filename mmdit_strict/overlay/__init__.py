"""The perturbation overlay: named semantic mismatches (ablation probes) applied to one side of a run.

``registry.py`` holds the mechanism (:class:`Perturbation`, the registry, :func:`perturbing`); ``builtin.py``
registers one perturbation per factor of the RFC's ablation list. The model and the sampling chain know
only the execution context's ``overlay`` field.
"""

from .registry import (PERTURBATIONS, Overlay, Perturbation, check_perturbations, get_perturbation, known_perturbations,
                       perturb_fields, perturbing, register_perturbation)

__all__ = ["PERTURBATIONS", "Overlay", "Perturbation", "check_perturbations", "get_perturbation", "known_perturbations",
           "perturb_fields", "perturbing", "register_perturbation"]
