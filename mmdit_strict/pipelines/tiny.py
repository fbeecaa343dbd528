"""A tiny random Qwen-Image pipeline folder, made offline (no download): for tests and demos.

Layout (what ``QwenImagePipeline.from_pretrained`` reads)::

    folder/
      model_index.json
      scheduler/scheduler_config.json        FlowMatchEulerDiscreteScheduler, Qwen-Image's settings
      text_encoder/{config.json, model.safetensors}   Qwen2_5_VLForConditionalGeneration, 2 layers, width 48
      tokenizer/{tokenizer.json, ...}        byte-level BPE over the 256 bytes + Qwen's chat tokens
      transformer/{config.json, diffusion_pytorch_model.safetensors}   the ``tiny`` MMDiT, random weights
      vae/{config.json, diffusion_pytorch_model.safetensors}           AutoencoderKLQwenImage, base_dim 8

Every component is drawn from ``seed`` on the CPU, so the same seed gives the same bytes. The text
encoder's hidden size equals the transformer's ``joint_attention_dim`` (48), the VAE's 16 latent
channels its ``out_channels``; pixels per latent are 8, so sides must be multiples of 16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# The tiny transformer (the ``tiny`` preset in diffusers' argument names).
TINY_TRANSFORMER: dict[str, Any] = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=(4, 6, 6),
)
# Qwen-Image's scheduler settings (scheduler/scheduler_config.json of the released pipeline).
QWEN_SCHEDULER: dict[str, Any] = dict(
    base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, num_train_timesteps=1000,
    shift=1.0, shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential",
)
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")


def tiny_tokenizer() -> Any:
    """A Qwen2 tokenizer over the 256 byte symbols (no merges) plus ``<|endoftext|>`` and the chat tokens."""
    import json
    import tempfile

    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {sym: i for i, sym in enumerate(bytes_to_unicode()[b] for b in range(256))}
    with tempfile.TemporaryDirectory() as d:  # vocab/merges files: the constructor both transformers 4 and 5 take
        (Path(d) / "vocab.json").write_text(json.dumps(vocab))
        (Path(d) / "merges.txt").write_text("#version: 0.2\n")
        tok = Qwen2Tokenizer(str(Path(d) / "vocab.json"), str(Path(d) / "merges.txt"))
    tok.add_special_tokens({"additional_special_tokens": list(CHAT_TOKENS)})
    return tok


def tiny_text_encoder(vocab_size: int, hidden: int, seed: int) -> Any:
    """A 2-layer Qwen2.5-VL (1-block vision tower) with ``hidden`` width, random weights from ``seed``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    extra = vocab_size  # image/video/vision token ids just past the text vocabulary
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=vocab_size + 4, max_position_embeddings=2048, rope_theta=1e6,
            rope_scaling={"type": "mrope", "mrope_section": [hidden // 12, hidden // 12, hidden // 12]},
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                           fullatt_block_indexes=[0]),
        image_token_id=extra, video_token_id=extra + 1, vision_start_token_id=extra + 2, vision_end_token_id=extra + 3,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    return model.eval()


def tiny_transformer(seed: int) -> Any:
    """diffusers' QwenImageTransformer2DModel at tiny size with non-trivial random weights."""
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel(**TINY_TRANSFORMER)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if "norm" in name else 0.08
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=gen))
    return model.eval()


def tiny_vae(seed: int) -> Any:
    """AutoencoderKLQwenImage with base_dim 8 (same 8× spatial factor and 16 latent channels as Qwen-Image's)."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    return AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                                  temperal_downsample=[False, True, True]).eval()


def build_tiny_pipeline(seed: int = 0) -> Any:
    """A ``QwenImagePipeline`` of tiny random components (FP32, CPU)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    tok = tiny_tokenizer()
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        vae=tiny_vae(seed + 1),
        text_encoder=tiny_text_encoder(len(tok), TINY_TRANSFORMER["joint_attention_dim"], seed + 2),
        tokenizer=tok,
        transformer=tiny_transformer(seed + 3),
    )


def save_tiny_pipeline(folder: str | Path, seed: int = 0) -> Path:
    """Write :func:`build_tiny_pipeline` as a diffusers pipeline folder (layout in the module docstring)."""
    folder = Path(folder)
    build_tiny_pipeline(seed).save_pretrained(str(folder), safe_serialization=True)
    return folder
