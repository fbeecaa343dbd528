"""CPU strict joint attention on packed variable-length samples.

Each sample attends over its own ``[text, image]`` tokens only; every product and reduction has a
shape set by that sample's own token count, on freshly allocated operands, so neither batch
composition nor prompt padding can change a byte. The fused operator is literally the composition
of the three unfused ones, so fused and unfused agree byte for byte.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..registry import KernelImpl, register
from .primitives import check_seqlens

_F32 = frozenset({torch.float32})


def joint_attn_qk_gemm(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One sample: q, k (H, L, d) → scores (H, L, L) = q kᵀ / √d."""
    return torch.bmm(q.contiguous().clone(), k.transpose(1, 2).contiguous().clone()) * (1.0 / math.sqrt(q.shape[-1]))


def joint_attn_softmax(s: torch.Tensor) -> torch.Tensor:
    """Row softmax of one sample's scores (H, L, L): max-subtracted exp over the sample's own keys."""
    m = s.amax(dim=-1, keepdim=True).detach()
    e = torch.exp(s - m)
    return e / e.sum(dim=-1, keepdim=True)


def joint_attn_av_gemm(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sample: probabilities (H, L, L) @ v (H, L, d) → (H, L, d)."""
    return torch.bmm(p.contiguous().clone(), v.contiguous().clone())


def joint_attention_fused(
    q_txt: torch.Tensor, k_txt: torch.Tensor, v_txt: torch.Tensor,
    q_img: torch.Tensor, k_img: torch.Tensor, v_img: torch.Tensor, *,
    txt_seqlens: Sequence[int], img_seqlens: Sequence[int], query_img_seqlens: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed joint attention: (Mt, H, d) text and (Mi, H, d) image rows → ((Mt, H·d), (Mi, H·d)).

    ``query_img_seqlens``: q_img holds that many image query rows per sample (a subset of its image rows,
    contiguous within the sample, as a sequence-parallel rank holds them) against the whole samples' keys
    and values; o_img has those rows. The products then run with the subset's row count, which this CPU's
    BLAS gives the same bytes per row for (checked where it is used: ``mmdit_strict.parallel``)."""
    tseq = check_seqlens(txt_seqlens, q_txt.shape[0], "q_txt")
    iseq = check_seqlens(img_seqlens, k_img.shape[0], "q_img" if query_img_seqlens is None else "k_img")
    qseq = iseq if query_img_seqlens is None else check_seqlens(query_img_seqlens, q_img.shape[0], "q_img")
    if not len(tseq) == len(iseq) == len(qseq):
        raise ValueError(f"txt_seqlens has {len(tseq)} samples but img_seqlens has {len(iseq)}")
    if query_img_seqlens is None and q_img.shape[0] != k_img.shape[0]:
        raise ValueError(f"q_img has {q_img.shape[0]} rows but k_img {k_img.shape[0]} (give query_img_seqlens for a subset)")
    for t in (q_txt, k_txt, v_txt, q_img, k_img, v_img):
        if t.dim() != 3 or t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"CPU strict joint attention needs float32 CPU (M, H, d) tensors, got {tuple(t.shape)} {t.dtype} {t.device}")
    H, d = q_img.shape[1:]
    outs_t, outs_i = [], []
    ts = is_ = qs = 0
    for nt, ni, nq in zip(tseq, iseq, qseq):
        def gather(a: torch.Tensor, b: torch.Tensor, start: int, n: int) -> torch.Tensor:
            return torch.cat([a[ts:ts + nt], b[start:start + n]], dim=0).transpose(0, 1)  # (H, L, d)

        q = gather(q_txt, q_img, qs, nq)
        k, v = gather(k_txt, k_img, is_, ni), gather(v_txt, v_img, is_, ni)
        o = joint_attn_av_gemm(joint_attn_softmax(joint_attn_qk_gemm(q, k)), v).transpose(0, 1).reshape(nt + nq, H * d)
        outs_t.append(o[:nt])
        outs_i.append(o[nt:])
        ts += nt
        is_ += ni
        qs += nq
    return torch.cat(outs_t, dim=0), torch.cat(outs_i, dim=0)


_ORDER = "per sample over its own [text, image] keys: one BMM per sample for QKᵀ and PV; row max/sum over own keys"
for _op, _fn in (("joint_attn_qk_gemm", joint_attn_qk_gemm), ("joint_attn_softmax", joint_attn_softmax),
                 ("joint_attn_av_gemm", joint_attn_av_gemm), ("joint_attention_fused", joint_attention_fused)):
    register(KernelImpl(op=_op, backend="cpu_strict", device="cpu", dtypes=_F32, fn=_fn, strict=True, split_k=False,
                        kernel_name=f"cpu_{_op}", reduction_order=_ORDER))
