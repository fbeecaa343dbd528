"""Prompt encoding with a Qwen-Image pipeline's Qwen2.5-VL text encoder (the Phase B text contract).

What one prompt becomes, step by step (the same steps as diffusers' ``QwenImagePipeline.encode_prompt``):

1. the prompt is placed in Qwen-Image's chat template (:data:`PROMPT_TEMPLATE`);
2. the tokenizer turns a batch of templated prompts into ids, padded to the longest and truncated
   at ``max_sequence_length + DROP_TOKENS`` tokens;
3. the text encoder runs with the padding mask and the **last hidden state** is taken;
4. each prompt's valid (unpadded) rows are selected and the first :data:`DROP_TOKENS` (34) rows —
   the system prompt and the user-turn header — are dropped;
5. the rows are zero-padded to the longest prompt of the batch, with a 0/1 ``int64`` mask.

By default prompts are encoded one per batch (``batch_size=1``), so a prompt's embedding never depends
on which other prompts were encoded with it; ``batch_size=N`` reproduces a batched diffusers call.

File written by :func:`write_prompt_file` (read by rollout and training through ``prompts.embeddings``)::

    prompts.safetensors
      prompt_embeds    (N, L, C)  text encoder dtype, rows past the mask are zero
      prompt_mask      (N, L)     int64, 1 = valid (prefix)
      negative_embeds  (L_neg, C) the negative prompt's valid rows; edit prompts encoded with their images
                       hold one negative per prompt instead: (N, L_neg, C), zero past its mask
      negative_mask    (N, L_neg) int64, only with per-prompt negatives
      header metadata  format, prompts (JSON), negative_prompt, template and its sha256, drop_tokens,
                       max_sequence_length, batch_size, dtype, tokenizer and text_encoder identities
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

# Qwen-Image's prompt template and the number of leading tokens its pipeline drops from the encoder output.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
DROP_TOKENS = 34
MAX_SEQUENCE_LENGTH = 1024
FILE_FORMAT = "mmdit-strict-prompts/1"


def template_sha256(template: str = PROMPT_TEMPLATE, drop_tokens: int = DROP_TOKENS) -> str:
    """Identity of the text contract's template: sha256 of the template text and the drop count."""
    return hashlib.sha256(f"{template}\x00{drop_tokens}".encode()).hexdigest()


def folder_identity(folder: str | Path, patterns: Sequence[str]) -> str:
    """sha256 over the names and bytes of small files (configs, tokenizer files) and the *headers* of
    safetensors files (names, dtypes, shapes, offsets) with their sizes: a cheap identity of a model
    folder that changes when any weight file is replaced, without hashing gigabytes of weights."""
    folder = Path(folder)
    h = hashlib.sha256()
    files = sorted({p for pat in patterns for p in folder.glob(pat) if p.is_file()})
    if not files:
        raise FileNotFoundError(f"no files matching {list(patterns)} in {folder}")
    for p in files:
        h.update(p.name.encode() + b"\x00")
        if p.suffix == ".safetensors":
            with open(p, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(n))
            h.update(str(p.stat().st_size).encode())
        else:
            h.update(p.read_bytes())
    return h.hexdigest()


@dataclass
class EncodedPrompts:
    """Prompt embeddings as diffusers' ``encode_prompt`` returns them, plus the negative prompt's rows."""

    prompt_embeds: torch.Tensor  # (N, L, C)
    prompt_mask: torch.Tensor  # (N, L) int64, prefix of ones
    negative_embeds: torch.Tensor | None  # (L_neg, C); or (N, L_neg, C) per prompt, with negative_mask
    prompts: list[str]
    negative_prompt: str | None
    negative_mask: torch.Tensor | None = None  # (N, L_neg) int64 when each prompt has its own negative


def encode_batch(tokenizer: Any, text_encoder: Any, prompts: Sequence[str], *, device: str | torch.device = "cpu",
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode one batch (steps 1-5 of the module docstring): ``(N, L, C)`` embeddings and ``(N, L)`` mask."""
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a non-empty list of strings")
    if not 1 <= max_sequence_length <= MAX_SEQUENCE_LENGTH:
        raise ValueError(f"max_sequence_length must be in [1, {MAX_SEQUENCE_LENGTH}], got {max_sequence_length}")
    text = [PROMPT_TEMPLATE.format(p) for p in prompts]
    tokens = tokenizer(text, max_length=MAX_SEQUENCE_LENGTH + DROP_TOKENS, padding=True, truncation=True,
                       return_tensors="pt").to(device)
    with torch.no_grad():
        out = text_encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True)
    hidden = out.hidden_states[-1]  # (N, T, C)
    valid = tokens.attention_mask.bool()
    lengths = valid.sum(dim=1).tolist()
    if min(lengths) <= DROP_TOKENS:
        raise ValueError(f"a templated prompt has {min(lengths)} tokens, not more than the {DROP_TOKENS} the template "
                         "drops: this tokenizer does not fit Qwen-Image's template")
    rows = [r[DROP_TOKENS:] for r in torch.split(hidden[valid], lengths, dim=0)]
    longest = max(r.shape[0] for r in rows)
    embeds = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
    mask = torch.stack([torch.cat([torch.ones(r.shape[0], dtype=torch.long, device=r.device),
                                   torch.zeros(longest - r.shape[0], dtype=torch.long, device=r.device)]) for r in rows])
    embeds = embeds.to(dtype=text_encoder.dtype)[:, :max_sequence_length]
    return embeds, mask[:, :max_sequence_length]


def encode_prompts(tokenizer: Any, text_encoder: Any, prompts: Sequence[str], negative_prompt: str | None = " ", *,
                   batch_size: int = 1, device: str | torch.device = "cpu",
                   max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> EncodedPrompts:
    """Encode ``prompts`` in batches of ``batch_size`` (padded to the longest overall) and the negative prompt alone."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a non-empty list of strings")
    parts = [encode_batch(tokenizer, text_encoder, prompts[i:i + batch_size], device=device,
                          max_sequence_length=max_sequence_length) for i in range(0, len(prompts), batch_size)]
    longest = max(e.shape[1] for e, _ in parts)
    embeds = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[1])) for e, _ in parts])
    mask = torch.cat([torch.nn.functional.pad(m, (0, longest - m.shape[1])) for _, m in parts])
    neg = None
    if negative_prompt is not None:
        ne, nm = encode_batch(tokenizer, text_encoder, [negative_prompt], device=device, max_sequence_length=max_sequence_length)
        neg = ne[0, : int(nm[0].sum())]
    return EncodedPrompts(embeds, mask, neg, list(prompts), negative_prompt)


def load_text_components(folder: str | Path, *, torch_dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """The tokenizer and Qwen2.5-VL text encoder of a diffusers pipeline folder (``tokenizer/``, ``text_encoder/``)."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    folder = Path(folder)
    for sub in ("tokenizer", "text_encoder"):
        if not (folder / sub).is_dir():
            raise FileNotFoundError(f"{folder} has no {sub}/ folder: pass a Qwen-Image pipeline folder")
    import transformers

    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # transformers renamed the argument in 4.56
    encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(folder / "text_encoder"), **{dtype_kw: torch_dtype})
    return tokenizer, encoder.to(device).eval()


def write_prompt_file(path: str | Path, enc: EncodedPrompts, *, pipeline_folder: str | Path, batch_size: int,
                      max_sequence_length: int = MAX_SEQUENCE_LENGTH, template: str = PROMPT_TEMPLATE,
                      drop_tokens: int = DROP_TOKENS, extra_metadata: dict[str, str] | None = None) -> Path:
    """Write ``enc`` (layout in the module docstring) atomically and byte-stably (same inputs, same
    bytes); the header names what made it (``template``/``drop_tokens``: the contract the prompts were
    encoded with; ``extra_metadata``: more header entries, e.g. the input images of edit prompts)."""
    from ..io import save_safetensors  # byte-stable header (sorted keys)

    if enc.negative_embeds is None:
        raise ValueError("the prompt file needs a negative prompt (rollout's CFG uses it); pass negative_prompt=' '")
    folder = Path(pipeline_folder)
    meta = {
        "format": FILE_FORMAT,
        "prompts": json.dumps(enc.prompts, ensure_ascii=False),
        "negative_prompt": enc.negative_prompt or "",
        "template": template,
        "template_sha256": template_sha256(template, drop_tokens),
        "drop_tokens": str(drop_tokens),
        "max_sequence_length": str(max_sequence_length),
        "batch_size": str(batch_size),
        "dtype": str(enc.prompt_embeds.dtype).removeprefix("torch."),
        "tokenizer": str(folder / "tokenizer"),
        "tokenizer_sha256": folder_identity(folder / "tokenizer", ["*.json", "*.txt", "*.model"]),
        "text_encoder": str(folder / "text_encoder"),
        "text_encoder_sha256": folder_identity(folder / "text_encoder", ["*.json", "*.safetensors"]),
        **(extra_metadata or {}),
    }
    tensors = {
        "prompt_embeds": enc.prompt_embeds.detach().to("cpu").contiguous(),
        "prompt_mask": enc.prompt_mask.detach().to("cpu").contiguous(),
        "negative_embeds": enc.negative_embeds.detach().to("cpu").contiguous(),
    }
    if enc.negative_mask is not None:
        tensors["negative_mask"] = enc.negative_mask.detach().to("cpu").contiguous()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_safetensors(tensors, tmp, metadata=meta)  # same prompts and encoder → same file bytes
    os.replace(tmp, path)
    return path


def read_prompt_metadata(path: str | Path) -> dict[str, Any]:
    """The header of a prompt file (``prompts`` decoded from JSON)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as fh:
        meta = dict(fh.metadata() or {})
    if "prompts" in meta:
        meta["prompts"] = json.loads(meta["prompts"])
    return meta
