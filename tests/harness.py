"""The one operator test harness: byte checks, invariance sweeps, accuracy against the FP64 reference.

Every operator implementation — the CPU strict backend, Triton kernels under ``TRITON_INTERPRET=1``
(FP32) and GPU kernels (FP32 and BF16) — is tested through these functions, so the checks mean the
same thing everywhere. Nothing here re-implements an operator: accuracy is always measured against a
caller-supplied reference (normally :mod:`mmdit_strict.reference`).

Vocabulary:
    target: where and in what dtype the implementation runs (:class:`Target`).
    item: one logical unit of a batch — a row for row-wise operators, a sample (its own rows) for
        per-sample operators. An item is a tensor or a tuple of tensors whose dim 0 is its rows.
    batch function: ``fn(items) -> outputs``, one output per item (a tensor or a tuple of tensors), in
        item order. :func:`rows_op` and :func:`packed_op` build batch functions for the two layouts.

All byte claims use :func:`assert_bytes_equal` (``torch.equal`` plus dtype and shape). Inputs are drawn
on the CPU in FP32 from a seeded generator and then moved/cast to the target, so every device sees the
same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import pytest
import torch

from mmdit_strict.tolerances import Tolerance

Item = Any  # torch.Tensor | tuple[torch.Tensor, ...]
Output = Any  # torch.Tensor | tuple[torch.Tensor, ...]
BatchFn = Callable[[Sequence[Item]], Sequence[Output]]

BATCH_SIZES = (2, 3, 64, 257)
TOKEN_COUNTS = (1, 7, 31, 32, 33, 100)  # includes non-multiples of the 32-row tile on both sides


# --------------------------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """Where an implementation runs: ``device`` (``cpu``/``cuda``) and execution ``dtype``."""

    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    @property
    def label(self) -> str:
        return f"{self.device}-{str(self.dtype).replace('torch.', '')}"

    def skip_unless_available(self) -> None:
        """Skip the calling test when this target cannot run here (no GPU in CI)."""
        if self.device == "cuda" and not torch.cuda.is_available():
            pytest.skip("no CUDA device")

    def put(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Move/cast a tensor to the target (floating tensors only change dtype)."""
        if t is None:
            return None
        return t.to(device=self.device, dtype=self.dtype if t.is_floating_point() else t.dtype)


CPU_FP32 = Target("cpu", torch.float32)


def randn(*shape: int, gen: torch.Generator, target: Target = CPU_FP32, scale: float = 1.0) -> torch.Tensor:
    """Seeded N(0, scale²) drawn on the CPU in FP32, then moved/cast to ``target``."""
    return target.put(scale * torch.randn(*shape, generator=gen, dtype=torch.float32))


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------ byte checks


def _flatten(out: Output) -> list[torch.Tensor | None]:
    if isinstance(out, torch.Tensor) or out is None:
        return [out]
    return [t for o in out for t in _flatten(o)]


def assert_bytes_equal(a: Any, b: Any, what: str) -> None:
    """Raw-byte equality of two tensors (or equally nested tuples of tensors / None).

    Checks dtype, shape and ``torch.equal``; on failure the message names ``what``, the first
    differing index, both values there, the max abs difference and how many elements differ.
    """
    fa, fb = _flatten(a), _flatten(b)
    if len(fa) != len(fb):
        raise AssertionError(f"{what}: {len(fa)} tensors vs {len(fb)} tensors")
    for i, (x, y) in enumerate(zip(fa, fb)):
        tag = what if len(fa) == 1 else f"{what}[{i}]"
        if x is None or y is None:
            if x is not y:
                raise AssertionError(f"{tag}: one side is None ({x is None}, {y is None})")
            continue
        if x.dtype != y.dtype:
            raise AssertionError(f"{tag}: dtype {x.dtype} vs {y.dtype}")
        if x.shape != y.shape:
            raise AssertionError(f"{tag}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
        if torch.equal(x, y):
            continue
        xc, yc = x.detach().cpu(), y.detach().cpu()
        if xc.is_floating_point():
            # NaNs compare unequal in torch.equal; compare bit patterns so NaN == same NaN.
            width = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[xc.element_size()]
            if torch.equal(xc.contiguous().view(width), yc.contiguous().view(width)):
                continue
        diff = xc != yc
        first = tuple(int(v) for v in diff.nonzero()[0]) if diff.any() else ()
        max_abs = float((xc.double() - yc.double()).abs().nan_to_num(float("inf")).max()) if xc.numel() else 0.0
        raise AssertionError(
            f"{tag}: bytes differ at {int(diff.sum())}/{diff.numel()} elements; first at index {first}: "
            f"{xc[first].item()!r} vs {yc[first].item()!r}; max abs diff {max_abs:.3e}"
        )


def clone_item(item: Item) -> Item:
    """Fresh storage for every tensor of an item (so no test aliases another call's buffers)."""
    if isinstance(item, torch.Tensor):
        return item.detach().clone()
    return tuple(clone_item(t) for t in item)


def item_rows(item: Item) -> int:
    return int((item if isinstance(item, torch.Tensor) else item[0]).shape[0])


def put_item(item: Item, target: Target) -> Item:
    """Every tensor of an item moved/cast to ``target`` (integer tensors keep their dtype)."""
    if isinstance(item, torch.Tensor):
        return target.put(item)
    return tuple(put_item(t, target) for t in item)


def slice_item(item: Item, n: int) -> Item:
    """The first ``n`` rows of every tensor of an item (per-sample vectors of one row stay whole)."""
    if isinstance(item, torch.Tensor):
        return item[:n].clone()
    return tuple(slice_item(t, n) for t in item)


# ------------------------------------------------------------------------------------- batch functions


def _as_tuple(item: Item) -> tuple[torch.Tensor, ...]:
    return item if isinstance(item, tuple) else (item,)


def rows_op(fn: Callable[..., Output]) -> BatchFn:
    """Batch function for row-wise operators.

    An item is one row: a tensor, or a tuple of tensors (e.g. the row and its upstream gradient).
    ``fn(*stacked)`` gets each position stacked over the items, ``(B, ...)``, and returns a tensor
    (or tuple of tensors) with one row per item.
    """

    def run(items: Sequence[Item]) -> list[Output]:
        tuples = [_as_tuple(i) for i in items]
        stacked = tuple(torch.stack([t[k].detach().clone() for t in tuples]) for k in range(len(tuples[0])))
        out = fn(*stacked)
        outs = out if isinstance(out, tuple) else (out,)
        per = [tuple(o[b] for o in outs) for b in range(len(items))]
        return [p if isinstance(out, tuple) else p[0] for p in per]

    return run


def packed_op(fn: Callable[..., Output]) -> BatchFn:
    """Batch function for per-sample operators on packed rows.

    An item is a sample: a tuple of tensors whose dim 0 is either the sample's rows (the count set by
    the first tensor) or 1 (a per-sample vector such as a modulation shift). ``fn(*packed, seqlens=)``
    gets each position concatenated over the samples — rows packed ``(M, ...)``, vectors ``(B, ...)`` —
    and returns packed outputs; an output with ``M`` rows is split back by ``seqlens``, one with ``B``
    rows one row per sample.
    """

    def run(items: Sequence[Item]) -> list[Output]:
        tuples = [_as_tuple(i) for i in items]
        seqlens = tuple(item_rows(t) for t in tuples)
        packed = tuple(torch.cat([t[k].detach().clone() for t in tuples]) for k in range(len(tuples[0])))
        out = fn(*packed, seqlens=seqlens)
        outs = out if isinstance(out, tuple) else (out,)
        per: list[list[torch.Tensor]] = [[] for _ in items]
        for o in outs:
            lens = seqlens if o.shape[0] == sum(seqlens) else (1,) * len(seqlens)
            if o.shape[0] != sum(lens):
                raise ValueError(f"output with {o.shape[0]} rows matches neither the {sum(seqlens)} rows nor the {len(seqlens)} samples")
            start = 0
            for b, n in enumerate(lens):
                per[b].append(o[start:start + n])
                start += n
        return [tuple(p) if isinstance(out, tuple) else p[0] for p in per]

    return run


# ------------------------------------------------------------------------------------ invariance sweeps


@dataclass
class _Singletons:
    """Each item run alone, computed once and cached by item index."""

    fn: BatchFn
    items: list[Item]
    cache: dict[int, Output] = field(default_factory=dict)

    def __getitem__(self, i: int) -> Output:
        if i not in self.cache:
            (self.cache[i],) = self.fn([self.items[i]])
        return self.cache[i]


def check_row_invariance(
    fn: BatchFn,
    make_item: Callable[[torch.Generator], Item],
    batch_sizes: Sequence[int] = BATCH_SIZES,
    *,
    target: Target = CPU_FP32,
    seed: int = 0,
    what: str = "op",
) -> None:
    """A logical item's output bytes do not depend on its batch.

    ``make_item(gen)`` draws one item (normally on the CPU in FP32); it is moved/cast to ``target``.

    For every ``B`` in ``batch_sizes``: a batch of ``B`` items (a different random selection and order
    per ``B``) — every item's output equals the item run alone (singleton), which covers every batch
    position; the reversed batch gives the reversed outputs; and one probe item placed first, in the
    middle and last among the others equals its singleton.
    """
    gen = generator(seed)
    pool = [put_item(make_item(gen), target) for _ in range(max(batch_sizes) + 1)]
    alone = _Singletons(fn, pool)
    order_gen = generator(seed + 1)
    for B in batch_sizes:
        idx = torch.randperm(len(pool), generator=order_gen)[:B].tolist()
        outs = fn([pool[i] for i in idx])
        if len(outs) != B:
            raise AssertionError(f"{what}: batch function returned {len(outs)} outputs for {B} items")
        for pos, i in enumerate(idx):
            assert_bytes_equal(outs[pos], alone[i], f"{what}: B={B} row at position {pos} vs alone")
        rev = fn([pool[i] for i in reversed(idx)])
        for pos in range(B):
            assert_bytes_equal(rev[B - 1 - pos], outs[pos], f"{what}: B={B} reversed batch, row {pos}")
        probe = idx[0]
        others = [pool[i] for i in idx[1:]]
        for pos in sorted({0, len(others) // 2, len(others)}):
            batch = others[:pos] + [pool[probe]] + others[pos:]
            assert_bytes_equal(fn(batch)[pos], alone[probe], f"{what}: B={B} probe at position {pos}")


def check_token_sweep(
    fn: BatchFn,
    make_item: Callable[[int, torch.Generator], Item],
    token_counts: Sequence[int] = TOKEN_COUNTS,
    *,
    target: Target = CPU_FP32,
    row_local: bool = False,
    seed: int = 0,
    what: str = "op",
) -> None:
    """Invariance over token counts (including non-multiples of every tile).

    ``make_item(n, gen)`` builds a sample of ``n`` rows (moved/cast to ``target``). Checks: samples of all ``token_counts``
    batched together (and in reverse) equal each sample alone. With ``row_local`` (row-wise math, e.g.
    GEMMs and norms), also: the first ``n`` rows of the longest sample, run as their own sample, equal
    the first ``n`` rows of the longest sample's output — a row does not depend on how many rows
    share its call (tiling).
    """
    gen = generator(seed)
    items = [put_item(make_item(int(n), gen), target) for n in token_counts]
    outs = fn(items)
    for n, item, out in zip(token_counts, items, outs):
        (single,) = fn([item])
        assert_bytes_equal(out, single, f"{what}: {n}-token sample batched with {list(token_counts)} vs alone")
    rev = fn(items[::-1])
    for k in range(len(items)):
        assert_bytes_equal(rev[len(items) - 1 - k], outs[k], f"{what}: reversed token sweep, sample {k}")
    if row_local:
        longest = max(range(len(items)), key=lambda k: item_rows(items[k]))
        full = outs[longest]
        for n in token_counts:
            (part,) = fn([slice_item(items[longest], int(n))])
            assert_bytes_equal(part, slice_item(full, int(n)), f"{what}: first {n} rows alone vs inside {item_rows(items[longest])} rows")


def check_padding_invariance(
    run: Callable[[int], Output], pads: Sequence[int], *, what: str = "op"
) -> None:
    """``run(pad)`` must give the same bytes for every amount of padding in ``pads``."""
    base = run(pads[0])
    for p in pads[1:]:
        assert_bytes_equal(run(p), base, f"{what}: padding {p} vs {pads[0]}")


def check_repeat_determinism(fn: Callable[[], Output], repeats: int = 3, *, what: str = "op") -> None:
    """Calling ``fn()`` again (fresh inputs built inside, or the same ones) gives the same bytes."""
    first = fn()
    for r in range(1, repeats):
        assert_bytes_equal(fn(), first, f"{what}: repeat {r} vs first run")


# ------------------------------------------------------------------------------------------- gradients


class MissingGradientError(AssertionError):
    """An input the caller asked a gradient for received none (autograd never reached it)."""


def run_with_grads(
    fn: Callable[..., Output],
    inputs: Sequence[Any],
    grad_out: Output,
    wrt: Sequence[int] | None = None,
    *,
    allow_missing: bool = False,
    **kwargs: Any,
) -> tuple[Output, tuple[torch.Tensor | None, ...]]:
    """Run ``fn(*inputs, **kwargs)`` with fresh leaves for the inputs in ``wrt`` and backpropagate ``grad_out``.

    ``wrt`` defaults to every floating tensor input. Returns ``(outputs (detached), grads)`` with one
    grad entry per input (None for inputs outside ``wrt``). An input in ``wrt`` that receives no
    gradient raises :class:`MissingGradientError` — a dropped gradient is never read as zeros; with
    ``allow_missing`` its entry is None instead, for a caller that compares it explicitly.
    """
    idx = _grad_indices(inputs, wrt)
    leaves = [
        (t.detach().clone().requires_grad_(True) if i in idx else t) for i, t in enumerate(inputs)
    ]
    with torch.enable_grad():
        out = fn(*leaves, **kwargs)
    outs = [o for o in _flatten(out)]
    gouts = _flatten(grad_out)
    if len(outs) != len(gouts):
        raise ValueError(f"fn returned {len(outs)} outputs but {len(gouts)} grad_out tensors were given")
    pairs = [(o, g) for o, g in zip(outs, gouts) if o is not None and o.requires_grad]
    wrt_leaves = [leaves[i] for i in idx]
    if pairs and wrt_leaves:
        grads = torch.autograd.grad([o for o, _ in pairs], wrt_leaves, [g for _, g in pairs], allow_unused=True)
    else:  # nothing to differentiate (no inputs asked for, or no output depends on them)
        grads = tuple(None for _ in wrt_leaves)
    it = iter(grads)
    full = tuple((next(it) if i in idx else None) for i in range(len(inputs)))
    missing = [i for i in idx if full[i] is None]
    if missing and not allow_missing:
        raise MissingGradientError(f"inputs {missing} received no gradient (asked for {idx})")
    detached = tuple(o.detach() if o is not None else None for o in outs)
    return (detached[0] if isinstance(out, torch.Tensor) else detached), full


def _grad_indices(inputs: Sequence[Any], wrt: Sequence[int] | None) -> list[int]:
    if wrt is not None:
        return list(wrt)
    return [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _compare(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, peer: torch.Tensor | None) -> tuple[bool, str]:
    passed, max_abs, max_rel = tol.check(actual, expected)
    msg = f"max_abs {max_abs:.3e}, max_rel {max_rel:.3e}, max|ref| {float(expected.abs().max()) if expected.numel() else 0.0:.3e}"
    if not passed and peer is not None:
        # flash-attention's three-way rule: no worse than twice PyTorch's own same-dtype error, plus atol.
        peer_err = float((peer.detach().cpu().double() - expected.detach().cpu().double()).abs().max())
        passed = max_abs <= 2 * peer_err + tol.resolved(expected).atol
        msg += f", peer max_abs {peer_err:.3e}"
    return passed, msg


def check_grad_accuracy(
    fn: Callable[..., Output],
    ref_fn: Callable[..., Output],
    inputs: Sequence[Any],
    tol: Tolerance | dict[str, Tolerance],
    *,
    target: Target = CPU_FP32,
    grad_out: Output | None = None,
    wrt: Sequence[int] | None = None,
    peer_fn: Callable[..., Output] | None = None,
    seed: int = 1234,
    what: str = "op",
    kwargs: dict[str, Any] | None = None,
) -> dict[str, str]:
    """Forward output(s) and the gradient of every input in ``wrt`` against the FP64 reference.

    ``inputs`` are moved/cast to ``target`` for ``fn``; the reference sees those same (rounded) values
    in FP64, so only the implementation's arithmetic is measured. ``grad_out`` defaults to seeded
    N(0, 1) per output. ``tol`` is one :class:`Tolerance` or ``{"fwd": ..., "grad": ...}``. With
    ``peer_fn`` (e.g. the production PyTorch op in the same dtype), an element bound that fails is
    retried as ``max_abs <= 2·peer_max_abs + atol``. Returns the error summary per compared tensor.
    """
    kwargs = kwargs or {}
    tol_fwd = tol["fwd"] if isinstance(tol, dict) else tol
    tol_grad = tol["grad"] if isinstance(tol, dict) else tol
    dev_inputs = [target.put(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    idx = _grad_indices(dev_inputs, wrt)
    with torch.no_grad():
        probe = fn(*[t.detach().clone() if isinstance(t, torch.Tensor) else t for t in dev_inputs], **kwargs)
    if grad_out is None:
        gen = generator(seed)
        grad_out = tuple(randn(*o.shape, gen=gen, target=target) for o in _flatten(probe))
        grad_out = grad_out[0] if isinstance(probe, torch.Tensor) else grad_out
    out, grads = run_with_grads(fn, dev_inputs, grad_out, idx, allow_missing=True, **kwargs)
    ref_inputs = [t.detach().to("cpu", torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in dev_inputs]
    ref_gout = tuple(g.detach().to("cpu", torch.float64) for g in _flatten(grad_out))
    ref_out, ref_grads = run_with_grads(ref_fn, ref_inputs, ref_gout if len(ref_gout) > 1 else ref_gout[0], idx,
                                        allow_missing=True, **kwargs)
    peer_out = peer_grads = None
    if peer_fn is not None:
        peer_out, peer_grads = run_with_grads(peer_fn, dev_inputs, grad_out, idx, allow_missing=True, **kwargs)
    report: dict[str, str] = {}
    failures = []
    for k, (a, e) in enumerate(zip(_flatten(out), _flatten(ref_out))):
        p = _flatten(peer_out)[k] if peer_out is not None else None
        ok, msg = _compare(a, e, tol_fwd, p)
        report[f"out{k}"] = msg
        if not ok:
            failures.append(f"forward output {k}: {msg}")
    for i in idx:
        if grads[i] is None or ref_grads[i] is None:
            # explicit: a gradient one side produces and the other drops is a failure, never zeros
            if grads[i] is not None or ref_grads[i] is not None:
                side = "the implementation" if grads[i] is None else "the reference"
                failures.append(f"grad of input {i}: {side} produced no gradient, the other side did")
            report[f"grad{i}"] = "no gradient on either side"
            continue
        p = peer_grads[i] if peer_grads is not None else None
        ok, msg = _compare(grads[i], ref_grads[i], tol_grad, p)
        report[f"grad{i}"] = msg
        if not ok:
            failures.append(f"grad of input {i}: {msg}")
    if failures:
        raise AssertionError(
            f"{what} on {target.label} vs FP64 reference (rtol {tol_fwd.rtol}/{tol_grad.rtol}, atol {tol_fwd.atol}/{tol_grad.atol}): "
            + "; ".join(failures)
        )
    return report


def left_fold(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``((t0 + t1) + t2) + ...`` in the given order, in the tensors' own dtype."""
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc = acc + t
    return acc


def check_param_grad_fold(
    fn: Callable[[Sequence[Item], Sequence[torch.Tensor]], Output],
    items: Sequence[Item],
    params: Sequence[torch.Tensor],
    grad_outs: Sequence[Output],
    *,
    what: str = "op",
) -> None:
    """Parameter gradients of a batch equal the left fold, in sample order, of each sample's gradient alone.

    ``fn(items, params)`` runs the operator on a batch of ``items`` with the parameter tensors
    ``params`` (fresh leaves are passed in) and returns one output per item; ``grad_outs[b]`` is the
    upstream gradient of item ``b``'s output, the same bytes batched and alone.
    """

    def grads_of(batch: Sequence[Item], gouts: Sequence[Output]) -> tuple[torch.Tensor, ...]:
        leaves = [p.detach().clone().requires_grad_(True) for p in params]
        with torch.enable_grad():
            outs = fn(batch, leaves)
        pairs = [(o, g) for out, gout in zip(outs, gouts) for o, g in zip(_flatten(out), _flatten(gout))]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
        missing = [k for k, g in enumerate(grads) if g is None]
        if missing:
            raise MissingGradientError(f"{what}: params {missing} received no gradient from a batch of {len(batch)}")
        return tuple(grads)

    batched = grads_of(items, grad_outs)
    alone = [grads_of([it], [g]) for it, g in zip(items, grad_outs)]
    for k in range(len(params)):
        assert_bytes_equal(batched[k], left_fold([a[k] for a in alone]), f"{what}: param {k} grad, batch vs fold of singletons")


# ------------------------------------------------------------------------------------------- bad inputs


@dataclass(frozen=True)
class BadCase:
    """One bad call: ``fn(*args, **kwargs)`` must raise ``ValueError`` whose message contains ``fragment``."""

    label: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    fragment: str = ""


def run_without_host_sync(fn: Callable[[], Any]) -> Any:
    """``fn()`` under ``torch.cuda.set_sync_debug_mode("error")``: any host-device synchronisation raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_bad_inputs(fn: Callable[..., Any], cases: Sequence[BadCase], *, error: type[Exception] = ValueError) -> None:
    """Each case raises ``error`` with its message fragment (case-insensitive); all failures reported together."""
    problems = []
    for case in cases:
        try:
            fn(*case.args, **case.kwargs)
        except error as exc:
            if case.fragment.lower() not in str(exc).lower():
                problems.append(f"{case.label}: message {str(exc)!r} lacks {case.fragment!r}")
        except Exception as exc:  # noqa: BLE001 - the wrong exception type is the failure being reported
            problems.append(f"{case.label}: raised {type(exc).__name__}: {exc} instead of {error.__name__}")
        else:
            problems.append(f"{case.label}: no error raised")
    if problems:
        raise AssertionError("bad-input checks failed:\n  " + "\n  ".join(problems))
