"""The markdown report of the row-operator qualification (:mod:`.norms`)."""

from __future__ import annotations

from . import markdown as md
from ..environment import environment_line

BATCHES = (2, 3, 8, 64)  # batch sizes of the invariance section
PADS = (0, 1, 7, 64, 256)  # companion length growths of the invariance section


def _f(v, spec=".3e"):
    return format(v, spec) if isinstance(v, (int, float)) else "—"


def _speed_row(s: dict) -> str:
    def bw(kind):
        if f"{kind}_gbps" not in s:
            return "—"
        return f"{s[kind + '_gbps']:.0f} ({s[kind + '_copy_gbps']:.0f}, {s[kind + '_fraction']:.2f})"

    return md.row(s["op"], s["dtype"], s["rows"], _f(s.get("fwd_ms"), ".4f"), bw("fwd"), _f(s.get("bwd_ms"), ".4f"), bw("bwd"),
                  _f(s.get("torch_fwd_ms"), ".4f"), _f(s.get("fwd_speedup_vs_torch"), ".2f"), _f(s.get("fwd_bwd_ms"), ".4f"),
                  _f(s.get("torch_fwd_bwd_ms"), ".4f"), _f(s.get("fwd_bwd_speedup_vs_torch"), ".2f"),
                  f"{_f(s.get('fwd_plain_ms'), '.4f')} ({_f(s.get('torch_fwd_plain_ms'), '.4f')}), "
                  f"{_f(s.get('fwd_bwd_plain_ms'), '.4f')} ({_f(s.get('torch_fwd_bwd_plain_ms'), '.4f')})")


def render(report: dict) -> str:
    e = report["env"]
    lines = ["# Strict row operators — GPU qualification report", "",
             environment_line(e), ""]
    lines += md.rows_section(
        report.get("accuracy"), lambda acc: f"Accuracy vs the FP64 CPU reference ({md.passed(acc)})",
        ("op", "dtype", "rows", "tensor", "max abs", "max\\|ref\\|", "rel-fro", "torch max abs", "pass"),
        lambda a: md.row(a["op"], a["dtype"], a["rows"], a["tensor"], _f(a["max_abs"]), _f(a["max_ref"]),
                         _f(a["rel_fro"], ".2e"), _f(a.get("torch_max_abs")), "PASS" if a["pass"] else "FAIL"),
        ["Rule (tolerances.yaml `row_ops.<op>[_grad].<dtype>`): `|kernel−ref| ≤ rtol·|ref| + atol_max·max|ref|` per tensor. "
         "`torch` = the production PyTorch op in the same dtype, for comparison."])
    lines += md.rows_section(
        report.get("invariance"),
        lambda inv: f"Raw-byte invariance ({sum(a['equal'] for a in inv)}/{sum(a['checked'] for a in inv)} tensors equal)",
        ("op", "dtype", "probe rows", "companion rows", "equal / checked", "failures"),
        lambda a: md.row(a["op"], a["dtype"], a["probe_rows"], "{}..{}".format(*a.get("companion_rows", ["?", "?"])),
                         f"{a['equal']}/{a['checked']}", ", ".join(a["failures"][:3])),
        [f"Every sample of batches B ∈ {list(BATCHES)} (the probe first, middle and last among random companions) vs the same "
         f"sample alone, and the probe with companions {list(PADS)} rows longer: forward output and every per-row / per-sample "
         "gradient, `torch.equal`."])
    lines += md.rows_section(
        report.get("speed"), "Speed (B = 1; CUDA-graph replay, GPU time)",
        ("op", "dtype", "rows", "fwd ms", "fwd GB/s (copy, fraction)", "bwd ms", "bwd GB/s (copy, fraction)", "torch fwd ms",
         "fwd speedup", "fwd+bwd ms", "torch fwd+bwd ms", "fwd+bwd speedup",
         "without graph: fwd ms (torch), fwd+bwd ms (torch)"),
        _speed_row,
        ["GB/s = bytes the kernel must move (reads + writes of its row tensors; weights for the GEMM ones) / time; "
         "copy = the faster of `dst.copy_(src)` and an SM copy kernel moving the same number of bytes, same run (`bench/bandwidth.py`; the driver's memcpy alone ran at 2.6 TB/s for some sizes). fwd+bwd and the eager PyTorch composition "
         "(`kernels/production.py`) both through autograd; speedup = torch ms / ours ms."])
    mt = report.get("model_trace")
    if mt:
        lines += [f"## qwen-image architecture, runtime=auto ({mt['layers']} blocks, grid {mt['grid']}, text {mt['txt_lens']}, {mt.get('dtype')})", "",
                  f"- forward fallbacks: {', '.join(mt['forward']) or 'none'}",
                  f"- forward + backward fallbacks: {', '.join(mt['forward+backward']) or 'none'}",
                  f"- backends: {', '.join(mt['forward_backends'])}", ""]
    return "\n".join(lines + md.errors_and_wall_time(report)) + "\n"
