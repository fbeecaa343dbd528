"""Model-parallel layouts of one side: how ``tp · sp · cfg`` ranks share one batch (pure functions).

A side's world of ``W`` ranks is a grid ``dp × cfg × sp × tp`` (``tp`` innermost, as Megatron orders it):
rank ``r`` has coordinates ``tp = r % tp``, ``sp = (r // tp) % sp``, ``cfg = (r // (tp·sp)) % cfg`` and
``dp = r // (tp·sp·cfg)``. The ``tp · sp · cfg`` ranks of one ``dp`` index form a *model group*: they
run the same batches, each computing its share of every forward; the ``dp`` groups split the samples as
single ranks did before (``distributed.layout``). With ``tp = sp = cfg = 1`` every rank is its own group.

Sequence shards: sample ``b`` with ``n_b`` image rows gives sequence rank ``k`` its rows
``[k·n_b // sp, (k+1)·n_b // sp)`` — contiguous, in order, sizes differing by at most one row, so a
length that ``sp`` does not divide (6889 tokens) needs no padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

ATTENTION = ("ulysses", "allgather")


@dataclass(frozen=True)
class ModelLayout:
    """One side's model-parallel degrees (``parallel`` section of ``rollout`` / ``recompute``).

    Attributes:
        tp: tensor-parallel degree: every GEMM of a block split by output columns over ``tp`` ranks, the
            attention heads with them (needs heads divisible by ``tp · sp``).
        sp: sequence-parallel degree: image rows of every sample split over ``sp`` ranks.
        cfg: CFG-parallel degree: 1, or 2 (the conditional and the negative branch on two ranks).
        attention: how sequence-parallel attention meets the whole sequence: ``ulysses`` (all-to-all from
            row shards to head shards and back; needs heads divisible by ``sp``) or ``allgather`` (every rank
            gathers the image K/V rows and attends with its own query rows; any head count).
    """

    tp: int = 1
    sp: int = 1
    cfg: int = 1
    attention: str = "ulysses"

    def __post_init__(self) -> None:
        for name in ("tp", "sp", "cfg"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{name} must be an integer >= 1, got {value!r}")
        if self.cfg not in (1, 2):
            raise ValueError(f"parallel.cfg must be 1 or 2 (one rank per CFG branch), got {self.cfg}")
        if self.attention not in ATTENTION:
            raise ValueError(f"parallel.attention must be one of {ATTENTION}, got {self.attention!r}")

    @classmethod
    def from_config(cls, section: Any) -> "ModelLayout":
        """From a config section with keys ``tp``, ``sp``, ``cfg``, ``attention`` (None → one rank)."""
        if section is None:
            return cls()
        get = section.get if hasattr(section, "get") else lambda k, d=None: getattr(section, k, d)
        return cls(tp=int(get("tp", 1)), sp=int(get("sp", 1)), cfg=int(get("cfg", 1)),
                   attention=str(get("attention", "ulysses")))

    @property
    def size(self) -> int:
        """Ranks in one model group: ``tp · sp · cfg``."""
        return self.tp * self.sp * self.cfg

    @property
    def trivial(self) -> bool:
        return self.size == 1

    def check(self, world: int, heads: int | None = None) -> None:
        """Raise ValueError when the layout cannot run on ``world`` ranks (or with ``heads`` attention heads)."""
        if world % self.size:
            raise ValueError(f"parallel layout tp={self.tp} sp={self.sp} cfg={self.cfg} needs a multiple of {self.size} "
                             f"ranks, got {world}")
        if heads is not None and self.tp > 1 and heads % self.tp:
            raise ValueError(f"parallel.tp={self.tp} splits the {heads} attention heads over its ranks: tp must divide "
                             f"the head count")
        if heads is not None and self.sp > 1 and self.attention == "ulysses" and (heads // self.tp) % self.sp:
            raise ValueError(f"parallel.attention=ulysses splits the {heads // self.tp} attention heads of a tensor rank "
                             f"over sp={self.sp} ranks: sp must divide the head count (divided by tp)")

    def coords(self, rank: int) -> dict[str, int]:
        """``{"dp", "cfg", "sp", "tp"}`` of ``rank``."""
        return {"dp": rank // self.size, "cfg": (rank // (self.tp * self.sp)) % self.cfg,
                "sp": (rank // self.tp) % self.sp, "tp": rank % self.tp}

    def groups(self, world: int) -> int:
        """Number of model groups (the data-parallel degree) on ``world`` ranks."""
        self.check(world)
        return world // self.size

    def group_ranks(self, world: int, axis: str) -> list[list[int]]:
        """Every group of ranks that differ only along ``axis`` (``"sp"``, ``"cfg"``, ``"model"``), each in
        coordinate order; every rank is in exactly one group of each axis."""
        self.check(world)
        if axis == "model":
            return [list(range(g * self.size, (g + 1) * self.size)) for g in range(world // self.size)]
        stride = {"tp": 1, "sp": self.tp, "cfg": self.tp * self.sp}[axis]
        degree = getattr(self, axis)
        out = []
        for r in range(world):
            if (r // stride) % degree == 0:
                out.append([r + i * stride for i in range(degree)])
        return out

    def leader(self, rank: int) -> int:
        """The first rank of ``rank``'s model group (it speaks for the group: rows, partials, files)."""
        return rank - rank % self.size

    def describe(self) -> dict[str, Any]:
        return {"tp": self.tp, "sp": self.sp, "cfg": self.cfg, "attention": self.attention}


def row_shards(lengths: Sequence[int], sp: int) -> list[list[tuple[int, int]]]:
    """Per sequence rank ``k``, per sample: the ``[start, stop)`` of its image rows within the sample."""
    if sp < 1:
        raise ValueError(f"sp must be >= 1, got {sp}")
    for n in lengths:
        if n < sp:
            raise ValueError(f"a sample with {n} image rows cannot be split over sp={sp} ranks (every rank needs a row)")
    return [[(k * n // sp, (k + 1) * n // sp) for n in lengths] for k in range(sp)]


def packed_rows(lengths: Sequence[int], sp: int, k: int) -> list[int]:
    """Rank ``k``'s rows as indices into the packed rows of every sample (sample after sample)."""
    out: list[int] = []
    base = 0
    for n, (a, b) in zip(lengths, row_shards(lengths, sp)[k]):
        out.extend(range(base + a, base + b))
        base += n
    return out


# operators whose outputs a tensor-parallel group splits by columns (the rest are whole on every tensor rank)
COLUMN_SHARDED = frozenset({"qkv_bias_gemm", "qk_rmsnorm", "multi_axis_rope", "joint_attention_fused",
                            "attn_out_bias_gemm", "mlp_up_gemm_gelu", "mlp_down_gemm"})


def row_owner(layout: "ModelLayout", leader: int, branch: str, region: str, row: int, rows: int, operator: str = "",
              element: int = 0, width: int = 0) -> str:
    """Which rank of a model group (first rank ``leader``) computed an operator output element: ``"rank 5 (sp 1
    of 2, cfg 1)"``. ``branch`` is ``cond`` / ``neg`` / ``sampling``; ``region`` the row's tokens (image rows are
    sharded over the sequence ranks; text rows, per-sample vectors and the sampling chain are computed by every
    sequence rank of the branch, and named by its first); ``rows`` the sample's image rows. Under tensor
    parallelism, ``operator``'s output ``element`` of a row ``width`` elements wide names the tensor rank whose
    columns hold it (:data:`COLUMN_SHARDED`); other operators are computed whole by every tensor rank."""
    cfg = 1 if (branch == "neg" and layout.cfg == 2) else 0
    k = 0
    if region in ("noisy latent", "conditioning image") and layout.sp > 1:
        shards = row_shards([rows], layout.sp)
        k = next(j for j in range(layout.sp) if shards[j][0][0] <= row < shards[j][0][1])
    sharded = layout.tp > 1 and operator in COLUMN_SHARDED and width > 0 and width % layout.tp == 0
    j = element // (width // layout.tp) if sharded else 0
    rank = leader + cfg * layout.tp * layout.sp + k * layout.tp + j
    parts = []
    if layout.tp > 1:
        parts.append(f"tp {j} of {layout.tp}" if sharded else f"replicated on the {layout.tp} tensor ranks")
    if layout.sp > 1:
        parts.append(f"sp {k} of {layout.sp}" if region in ("noisy latent", "conditioning image")
                     else f"replicated on the {layout.sp} sequence ranks")
    if layout.cfg > 1:
        parts.append(f"cfg {cfg}")
    return f"rank {rank}" + (f" ({', '.join(parts)})" if parts else "")
