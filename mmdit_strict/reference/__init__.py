"""Independent CPU references (FP64) of every model operator and of the whole Qwen-Image forward.

Shares no code with :mod:`mmdit_strict.kernels` or :mod:`mmdit_strict.model` (docs/design.md §3, §10): tests
check kernels and models against these. Written for clarity, not speed.
"""

from mmdit_strict.reference.model import reference_forward
from mmdit_strict.reference.ops import (
    adaln_gate_residual,
    adaln_modulation,
    final_adaln_out,
    gelu_tanh,
    joint_attention,
    latent_denormalize,
    latent_normalize,
    latent_pack,
    latent_unpack,
    layernorm,
    linear,
    multi_axis_rope,
    qk_rmsnorm,
    reference_grads,
    rmsnorm,
    row_sample_index,
    silu,
    timestep_embed_mlp,
    timestep_embedding,
    txt_in_rmsnorm_linear,
)
from mmdit_strict.reference.rope import (
    axis_inverse_frequencies,
    image_positions,
    image_token_count,
    rope_angles,
    rope_tables,
    text_positions,
)

__all__ = [
    "adaln_gate_residual",
    "adaln_modulation",
    "axis_inverse_frequencies",
    "final_adaln_out",
    "gelu_tanh",
    "image_positions",
    "image_token_count",
    "joint_attention",
    "latent_denormalize",
    "latent_normalize",
    "latent_pack",
    "latent_unpack",
    "layernorm",
    "linear",
    "multi_axis_rope",
    "qk_rmsnorm",
    "reference_forward",
    "reference_grads",
    "rmsnorm",
    "rope_angles",
    "rope_tables",
    "row_sample_index",
    "silu",
    "text_positions",
    "timestep_embed_mlp",
    "timestep_embedding",
    "txt_in_rmsnorm_linear",
]
