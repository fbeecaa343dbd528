"""The ablation experiment: named perturbations of one side (the overlay), invariant controls, the four
training–rollout runtime combinations, and one report."""

from .overlay import PERTURBATIONS, Overlay, Perturbation, get_perturbation, known_perturbations, perturbing, register_perturbation

__all__ = ["PERTURBATIONS", "Overlay", "Perturbation", "get_perturbation", "known_perturbations", "perturbing",
           "register_perturbation"]
