"""The survey loop: every case of the chosen families, every implementation each peer offers for it, through
the same invariance, accuracy and speed checks as ours (:mod:`.harness`), into one report dict."""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any, Callable, Sequence

import torch

from ...dtypes import EXECUTION_BY_SHORT_NAME as DTYPES
from . import liger, megatron, ours, sdpa, torch_det
from .cases import FAMILIES, Case, cases
from .harness import accuracy, invariance, speed
from .impl import Impl, Missing
from .plans import Profile, accuracy_widths

#: peer name → adapter module (``implementations(cases, device, dtype)``); "ours" is always run first.
ADAPTERS: dict[str, ModuleType] = {"ours": ours, "torch-deterministic": torch_det, "sdpa": sdpa,
                                   "liger-kernel": liger, "megatron-core": megatron}
#: batch-invariant kernel sets the survey cannot run, and why.
NOT_RUN: dict[str, str] = {
    "vllm": "its batch-invariant kernels (vllm.model_executor.layers.batch_invariant) ship inside the vLLM engine, "
            "whose wheels pin their own torch build and compiled CUDA extensions: not installable beside this "
            "project's torch without network",
    "sglang": "its deterministic-inference kernels ship inside the SGLang server with the compiled sgl-kernel "
              "package pinned to its own torch: not installable beside this project's torch without network",
    "flash-attn": "a compiled CUDA extension that must match the installed torch and CUDA; no matching wheel is "
                  "carried and building it needs nvcc and far more than the survey's time (its deterministic "
                  "backward is also reachable only through its own API, not SDPA)",
}


def check_names(peers: Sequence[str], families: Sequence[str]) -> None:
    """Refuse unknown peer or family names with the list of known ones."""
    bad = [p for p in peers if p not in ADAPTERS]
    if bad:
        raise ValueError(f"unknown peer(s) {bad}; the peers are {list(ADAPTERS)} (not run here: {list(NOT_RUN)})")
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        raise ValueError(f"unknown famil{'y' if len(bad) == 1 else 'ies'} {bad}; the families are {list(FAMILIES)}")


def _draw(case: Case, dtype: torch.dtype, device: str) -> Callable[[tuple[int, ...], int], tuple]:
    return lambda sizes, key: case.sample(sizes, torch.Generator(device=device).manual_seed(key), dtype)


def _shared(case: Case, dtype: torch.dtype, device: str, seed: int) -> tuple:
    return case.shared(torch.Generator(device=device).manual_seed(seed), dtype)


def _impls(case: Case, peers: Sequence[str], device: str, dtype: torch.dtype) -> list[Impl | Missing]:
    order = ["ours"] + [p for p in peers if p != "ours"]
    return [i for p in order for i in ADAPTERS[p].implementations([case], device, dtype)]


def survey(prof: Profile, families: Sequence[str] = FAMILIES, peers: Sequence[str] = tuple(ADAPTERS),
           device: str = "cuda", sections: Sequence[str] = ("invariance", "accuracy", "speed"),
           budget_s: float = 1e9, flush: Callable[[dict], None] | None = None,
           extra_impls: Sequence[Impl] = ()) -> dict[str, Any]:
    """Run the survey; returns the report dict (``flush(report)`` after every case, so a run cut short keeps
    what it measured). ``extra_impls`` join the peers (the tests' deliberately non-invariant toy)."""
    check_names(peers, families)
    t0 = time.time()
    rep: dict[str, Any] = {"profile": prof.name, "device": device, "families": list(families), "peers": list(peers),
                           "not_run": dict(NOT_RUN), "implementations": [], "invariance": [], "accuracy": [],
                           "speed": [], "errors": []}

    def guarded(what: str, fn: Callable[[], Any], row: dict) -> Any:
        if time.time() - t0 > budget_s:
            row["error"] = f"skipped (wall-time budget {budget_s:.0f} s)"
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a peer that fails is a result of the survey, not its end
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            return None

    acc_cases = {c.op: c for c in cases(accuracy_widths(prof), families)}
    for seed, case in enumerate(cases(prof.widths, families)):
        for dname in prof.dtypes:
            dtype = DTYPES[dname]
            found = _impls(case, peers, device, dtype) + [i for i in extra_impls if i.op == case.op]
            impls = [i for i in found if isinstance(i, Impl)]
            for i in found:
                rep["implementations"].append({"family": case.family, "op": case.op, "dtype": dname, "peer": i.peer, "name": i.name,
                                               **({"note": i.note} if isinstance(i, Impl) else {"missing": i.reason})})
            plan = prof.plan(case, dname)
            base = {"family": case.family, "op": case.op, "dtype": dname}
            shared = _shared(case, dtype, device, 1000 + seed)
            if "invariance" in sections:
                for impl in impls:
                    row = {**base, "name": impl.name}
                    res = guarded("invariance", lambda: invariance(case, impl, dtype, plan.invariance, shared,
                                                                   _draw(case, dtype, device), 20 + seed), row)
                    rep["invariance"].append({**row, **(res or {})})
            if "accuracy" in sections:
                acase = acc_cases[case.op]
                ashared = _shared(acase, dtype, device, 2000 + seed)
                aimpls = [i for i in _impls(acase, peers, device, dtype) + [i for i in extra_impls if i.op == case.op]
                          if isinstance(i, Impl)]
                for sizes, batch in plan.accuracy:
                    samples = [_draw(acase, dtype, device)(sizes, 40_000 + 97 * seed + b) for b in range(batch)]
                    for impl in aimpls:  # one implementation at a time, so one failing peer does not hide the others
                        row = {**base, "name": impl.name, "sizes": list(sizes), "batch": batch}
                        res = guarded("accuracy", lambda: accuracy(acase, [impl], dname, samples, ashared, 50 + seed), row)
                        tensors = (res or {}).get(impl.name, [])
                        rep["accuracy"].append({**row, "tensors": tensors, "failing": sum(not t["pass"] for t in tensors)})
            if "speed" in sections:
                for label, (sizes, batch) in plan.speed.items():
                    samples = [_draw(case, dtype, device)(sizes, 60_000 + b) for b in range(batch)]
                    for impl in impls:
                        row = {**base, "name": impl.name, "size": label, "sizes": list(sizes), "batch": batch}
                        res = guarded("speed", lambda: speed(case, impl, samples, shared), row)
                        rep["speed"].append({**row, **(res or {})})
                    if device == "cuda":
                        torch.cuda.empty_cache()
            rep["wall_s"] = time.time() - t0
            if flush:
                flush(rep)
    rep["wall_s"] = time.time() - t0
    return rep
