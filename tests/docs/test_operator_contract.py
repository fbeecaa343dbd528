"""docs/operators.md and tolerances.yaml agree with the code.

* Every operator signature documented in docs/operators.md (the GEMM family line and the "Other
  operators" table) matches ``inspect.signature`` of every registered implementation of that operator:
  the same positional parameters in order, the documented keyword-only parameters, the documented
  defaults (and no default the docs do not state). A backend may add keyword-only parameters that have
  defaults; it may not add a required one or drop a documented one.
* Every operator with a production, CPU strict or Triton implementation is documented there.
* The shapes in the "Other operators" table are the shapes the code takes and returns: every CPU
  implementation (production and CPU strict) is called with tensors of the documented input shapes
  (each dimension letter a distinct size) and must return the documented output shapes.
* Every tolerance entry loads under one meaning per key (``rtol``, ``atol`` absolute, ``atol_max`` a
  fraction of max|expected|) and states a reason.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mmdit_strict.kernels import registry
from mmdit_strict.tolerances import all_entries, from_entry

ROOT = Path(__file__).resolve().parents[2]
OPERATORS_MD = ROOT / "docs" / "operators.md"
KERNEL_BACKENDS = ("torch", "cpu_strict", "triton")
_NO_DEFAULT = object()


@dataclass(frozen=True)
class DocParam:
    name: str
    keyword_only: bool
    default: object = _NO_DEFAULT


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def parse_signature(sig: str) -> list[DocParam]:
    """``(x (M, K), gain (d,), *, seqlens, lora=None) -> ...`` → parameters (names, keyword-only, defaults).

    A piece is ``name``, ``name <shape/dtype note>`` or ``name=<Python literal>``; ``*`` starts the
    keyword-only parameters. Only the first parenthesised group (the parameter list) is read.
    """
    sig = sig.strip()
    if not sig.startswith("("):
        raise ValueError(f"a documented signature starts with '(': {sig!r}")
    depth = 0
    for end, ch in enumerate(sig):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            break
    params, kw_only = [], False
    for piece in _split_top_level(sig[1:end]):
        if piece == "*":
            kw_only = True
            continue
        m = re.match(r"^([A-Za-z_]\w*)\s*(=\s*(.+))?", piece)
        if not m:
            raise ValueError(f"cannot read parameter {piece!r} in {sig!r}")
        default = ast.literal_eval(m.group(3).strip()) if m.group(2) else _NO_DEFAULT
        params.append(DocParam(m.group(1), kw_only, default))
    return params


def documented_signatures(text: str) -> dict[str, list[DocParam]]:
    """{operator: documented parameters} from docs/operators.md's GEMM family line and operator table."""
    docs: dict[str, list[DocParam]] = {}
    sections = re.split(r"^## ", text, flags=re.M)
    gemm = next(s for s in sections if s.startswith("GEMM family"))
    (line,) = re.findall(r"^`gemm(\(.*\)) -> \w+`$", gemm, flags=re.M)
    family = gemm[gemm.index("Operators of this family"):]
    for op in re.findall(r"`(\w+)`", family):
        if op in registry.OPERATORS:
            docs[op] = parse_signature(line)
    other = next(s for s in sections if s.startswith("Other operators"))
    for op, sig in re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", other, flags=re.M):
        if op in docs:
            raise ValueError(f"{op} is documented twice")
        docs[op] = parse_signature(sig)
    return docs


def signature_problems(op: str, documented: list[DocParam], fn) -> list[str]:
    """Where ``fn``'s signature departs from the documented one (empty when they agree)."""
    where = f"{op} ({getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)})"
    params = list(inspect.signature(fn).parameters.values())
    problems = []
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        problems.append(f"{where}: takes *args/**kwargs, so its parameters cannot be checked against the docs")
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword = {p.name: p for p in params if p.kind is p.KEYWORD_ONLY}
    doc_pos = [d for d in documented if not d.keyword_only]
    doc_kw = {d.name: d for d in documented if d.keyword_only}
    if [p.name for p in positional] != [d.name for d in doc_pos]:
        problems.append(f"{where}: positional parameters {[p.name for p in positional]}, documented {[d.name for d in doc_pos]}")
    for name in doc_kw:
        if name not in keyword:
            problems.append(f"{where}: documented keyword-only parameter {name!r} is not taken "
                            f"(keyword-only: {list(keyword)}, positional: {[p.name for p in positional]})")
    for name, p in keyword.items():
        if name not in doc_kw and p.default is p.empty:
            problems.append(f"{where}: required keyword-only parameter {name!r} is not documented")
    by_name = {p.name: p for p in params}
    for d in documented:
        p = by_name.get(d.name)
        if p is None:
            continue
        has_default = p.default is not p.empty
        if d.default is _NO_DEFAULT and has_default:
            problems.append(f"{where}: {d.name} defaults to {p.default!r} in the code, the docs state no default")
        elif d.default is not _NO_DEFAULT and (not has_default or p.default != d.default):
            problems.append(f"{where}: {d.name} documented default {d.default!r}, code "
                            f"{p.default if has_default else 'none'!r}")
    return problems


def test_documented_signatures_match_every_registered_implementation() -> None:
    docs = documented_signatures(OPERATORS_MD.read_text(encoding="utf-8"))
    assert len(docs) >= 15, f"parsed only {sorted(docs)} from {OPERATORS_MD.name}"
    problems = []
    for op, documented in sorted(docs.items()):
        impls = registry.implementations(op)
        if not impls:
            problems.append(f"{op}: documented but no implementation is registered")
        for fn in {id(i.fn): i.fn for i in impls}.values():  # production registers one fn per device
            problems += signature_problems(op, documented, fn)
    assert not problems, "docs/operators.md disagrees with the code:\n" + "\n".join(problems)


def test_every_kernel_operator_is_documented() -> None:
    docs = documented_signatures(OPERATORS_MD.read_text(encoding="utf-8"))
    kernel_ops = {i.op for i in registry.implementations() if i.backend in KERNEL_BACKENDS}
    missing = sorted(kernel_ops - set(docs))
    assert not missing, f"operators with kernel implementations but no signature in docs/operators.md: {missing}"


def test_the_signature_check_catches_drift() -> None:
    """The comparison fails on the drift it exists for: a documented argument the code does not take,
    a missing documented default, a renamed positional, an undocumented required keyword."""

    def timestep(sigma, w1, b1, w2, b2, *, channels, scale):
        return None

    def gemm(x, weight, bias=None, *, seqlens, prologue="none", epilogue="none", lora=None, block=None):
        return None

    assert not signature_problems("t", parse_signature("(sigma (B,) fp32, w1, b1, w2, b2, *, channels, scale) -> (B, D)"), timestep)
    assert "'dtype' is not taken" in " ".join(
        signature_problems("t", parse_signature("(sigma (B,) fp32, w1, b1, w2, b2, *, channels, scale, dtype) -> (B, D)"), timestep))
    doc = 'x, weight, bias=None, *, seqlens, prologue="none", epilogue="none", lora=None'
    assert not signature_problems("g", parse_signature(f"({doc}) -> y"), gemm)  # extra optional keyword allowed
    assert "docs state no default" in " ".join(signature_problems("g", parse_signature(f"({doc.replace('bias=None', 'bias')})"), gemm))
    gelu_doc = doc.replace('epilogue="none"', 'epilogue="gelu"')
    assert "documented default 'gelu'" in " ".join(signature_problems("g", parse_signature(f"({gelu_doc})"), gemm))
    assert "positional parameters" in " ".join(signature_problems("g", parse_signature(f"({doc.replace('weight', 'w')})"), gemm))

    def strict_gemm(x, weight, bias=None, *, seqlens, prologue="none", epilogue="none", lora=None, tile):
        return None

    assert "required keyword-only parameter 'tile'" in " ".join(signature_problems("g", parse_signature(f"({doc})"), strict_gemm))


# One size per dimension letter of docs/operators.md, all different, so a documented dimension the code
# reads as another one shows. Packed rows: M = sum(SEQLENS) over B samples; joint attention: Mt / Mi
# text / image rows; the unfused trio: one sample of L tokens.
DIMS = {"B": 2, "M": 5, "Mt": 3, "Mi": 7, "L": 11, "H": 2, "d": 4, "D": 6, "N": 10, "Ct": 9, "C": 8}
SHAPE_KWARGS = {"seqlens": (2, 3), "txt_seqlens": (1, 2), "img_seqlens": (3, 4), "eps": 1e-6, "channels": DIMS["C"],
                "scale": 1000.0}


def _dims(text: str) -> tuple[int, ...]:
    """``"M, H·d"`` → sizes under :data:`DIMS` (``2D`` = 2·D, ``d/2``, ``H·d``)."""
    out = []
    for expr in filter(None, (e.strip() for e in text.split(","))):
        py = re.sub(r"(\d)([A-Za-z])", r"\1*\2", expr.replace("·", "*").replace("/", "//"))
        if not re.fullmatch(r"[A-Za-z0-9*/ ]+", py):
            raise ValueError(f"cannot read dimension {expr!r}")
        out.append(eval(py, {"__builtins__": {}}, dict(DIMS)))
    return tuple(out)


def documented_shapes(sig: str) -> tuple[dict[str, tuple[int, ...]], list[tuple[int, ...]]]:
    """``"(x (M, D), a, b (B, D), *, eps) -> (M, D)"`` → ({input: shape}, [output shapes]) under :data:`DIMS`.

    Names listed before a shape share it (``q, k (M, H, d)``); the outputs are the one shape after
    ``->`` or, for a tuple, each named part's shape."""
    params, ret = sig.split("->")
    inputs, pending = {}, []
    for piece in _split_top_level(params.strip()[1:-1]):
        if piece == "*":
            break
        m = re.match(r"^(\w+)\s*(?:\(([^)]*)\))?", piece)
        pending.append(m.group(1))
        if m.group(2) is not None:
            inputs.update({name: _dims(m.group(2)) for name in pending})
            pending = []
    if pending:
        raise ValueError(f"no documented shape for {pending} in {sig!r}")
    ret = ret.strip()
    parts = _split_top_level(ret[1:-1]) if re.match(r"^\(\w+ \(", ret) else [ret]
    return inputs, [_dims(re.search(r"\(([^()]*)\)\s*$", p).group(1)) for p in parts]


def shape_problems(op: str, sig: str, fn) -> list[str]:
    """Where ``fn`` called with the documented input shapes fails or returns other than the documented shapes."""
    inputs, outputs = documented_shapes(sig)
    gen = torch.Generator().manual_seed(0)
    args = [torch.rand(shape, generator=gen) for shape in inputs.values()]
    wanted = {n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}
    kwargs = {k: v for k, v in SHAPE_KWARGS.items() if k in wanted}
    where = f"{op} ({getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)})"
    try:
        out = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001  (the documented shapes do not run: that is the finding)
        return [f"{where}: raises with the documented input shapes {list(inputs.values())}: {type(exc).__name__}: {exc}"]
    got = [tuple(t.shape) for t in (out if isinstance(out, tuple) else (out,))]
    return [] if got == outputs else [f"{where}: returns shapes {got}, documented {outputs}"]


def _other_operators(text: str) -> dict[str, str]:
    other = next(s for s in re.split(r"^## ", text, flags=re.M) if s.startswith("Other operators"))
    return dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", other, flags=re.M))


def test_documented_shapes_are_what_every_cpu_implementation_takes_and_returns() -> None:
    table = _other_operators(OPERATORS_MD.read_text(encoding="utf-8"))
    assert len(table) >= 10, f"parsed only {sorted(table)} from {OPERATORS_MD.name}"
    problems, ran = [], 0
    for op, sig in sorted(table.items()):
        impls = [i for i in registry.implementations(op) if i.device == "cpu" and torch.float32 in i.dtypes]
        if not impls:
            problems.append(f"{op}: no CPU fp32 implementation to check the documented shapes on")
        for impl in impls:
            problems += shape_problems(op, sig, impl.fn)
            ran += 1
    assert not problems, "docs/operators.md shapes disagree with the code:\n" + "\n".join(problems)
    assert ran >= 2 * len(table), f"only {ran} implementations checked for {len(table)} operators"


def test_the_shape_check_catches_drift() -> None:
    """A documented output shape the code does not return, and a documented input shape it cannot take, are
    reported; the table's own signature passes."""
    from mmdit_strict.kernels import production as P

    sig = _other_operators(OPERATORS_MD.read_text(encoding="utf-8"))["txt_in_rmsnorm_linear"]
    assert not shape_problems("t", sig, P.txt_in_rmsnorm_linear)
    assert "returns shapes [(5, 10)], documented [(5, 6)]" in " ".join(
        shape_problems("t", sig.replace("-> (M, N)", "-> (M, D)"), P.txt_in_rmsnorm_linear))
    assert "raises with the documented input shapes" in " ".join(
        shape_problems("t", sig.replace("gain (Ct,)", "gain (D,)"), P.txt_in_rmsnorm_linear))
    inputs, outputs = documented_shapes("(q, k (H, L, d), w (2D, d/2)) -> (a (M, H·d), b (Mi,))")
    assert inputs == {"q": (2, 11, 4), "k": (2, 11, 4), "w": (12, 2)} and outputs == [(5, 8), (7,)]


def _tolerance_entries() -> list[tuple[str, object]]:
    out = []
    for section, checks in all_entries().items():
        assert isinstance(checks, dict), f"tolerances.yaml section {section!r} is not a mapping"
        for check, per_dtype in checks.items():
            assert isinstance(per_dtype, dict), f"tolerances.yaml {section}.{check} is not a mapping of dtypes"
            for dtype, entry in per_dtype.items():
                out.append((f"{section}.{check}.{dtype}", entry))
    return out


def test_every_tolerance_entry_has_one_meaning_per_key_and_a_reason() -> None:
    entries = _tolerance_entries()
    assert len(entries) > 50
    problems = []
    for where, entry in entries:
        try:
            tol = from_entry(entry, where)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if min(tol.rtol, tol.atol, tol.atol_max) < 0:
            problems.append(f"{where}: negative bound {tol}")
    assert not problems, "tolerances.yaml:\n" + "\n".join(problems)


@pytest.mark.parametrize("entry,fragment", [
    ({"rtol": 1e-5, "atol": 1e-5}, "reason"),
    ({"rtol": 1e-5, "atol": 1e-5, "reason": "  "}, "reason"),
    ({"rtol": 1e-5, "reason": "no absolute part"}, "one of atol"),
    ({"rtol": 1e-5, "atol": 1e-5, "atol_rel": 1e-3, "reason": "a third meaning"}, "unknown keys"),
])
def test_a_tolerance_entry_without_reason_or_with_an_unknown_key_is_refused(entry, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        from_entry(entry, "test.entry.fp32")
