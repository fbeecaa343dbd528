"""The K-split (row-parallel TP) arithmetic (:mod:`mmdit_strict.kernels.ksplit`) and its benchmark on the CPU.

Two engines compute the FP32 chunk products: ``"cpu"`` (the CPU strict engine's tile product) and
``"triton"`` (the strict GEMM engine; here under the interpreter, FP32 only, ``interp`` tests). What is
compared:

* ``t = 1`` against the unsplit product of the same engine, in bytes: the CPU strict GEMM (the same tile
  product of the same values, then the same bias add) and ``gemm_fwd`` (the same K loop; the bias add
  and the cast moved out of the kernel are the same IEEE operations);
* ``t > 1`` against the FP64 reference ``reference.ops.linear`` under ``tolerances.yaml``
  ``gemm.forward.fp32`` (a different tree, so bytes are not expected to match);
* raw-byte batch invariance (a sample's rows alone vs inside a batch), the fixed tree order (a crafted
  input where another order gives other bytes), and the refusals (t not dividing K, chunks off the K step).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmdit_strict.bench import ksplit as bench
from mmdit_strict.kernels import ksplit as KS
from mmdit_strict.kernels.cpu.gemm import gemm as cpu_gemm
from mmdit_strict.reference import ops as ref_ops
from mmdit_strict.tolerances import tolerance
from tests.harness import Target
from tests.kernels.triton_rows import G, interp, skip_unless_compiled

M, K, N = 37, 128, 40  # tiny-class Triton configuration: BLOCK_K 16, so t = 8 gives 16-wide chunks
ENGINES = [pytest.param("cpu", id="cpu"), pytest.param("triton", id="triton", marks=interp)]


def _inputs(m: int = M, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, K, generator=g), torch.randn(N, K, generator=g) / K**0.5, torch.randn(N, generator=g)


def test_cpu_t1_equals_the_cpu_strict_gemm_bytes() -> None:
    x, w, b = _inputs()
    assert torch.equal(KS.ksplit_linear(x, w, b, t=1, engine="cpu"), cpu_gemm(x, w, b, seqlens=(M,)))


@interp
def test_triton_t1_equals_the_unsplit_engine_bytes() -> None:
    x, w, b = _inputs()
    assert torch.equal(KS.ksplit_linear(x, w, b, t=1, engine="triton"), G.gemm_fwd(x, w, b)[0])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("t", [2, 4, 8])
def test_split_matches_fp64_within_the_forward_contract(engine: str, t: int) -> None:
    x, w, b = _inputs()
    ref = ref_ops.linear(x.double(), w.double(), b.double())
    ok, max_abs, _ = tolerance("gemm", "forward", torch.float32).check(KS.ksplit_linear(x, w, b, t=t, engine=engine), ref)
    assert ok, f"t={t} {engine}: max abs error {max_abs:.3e}"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("t", [2, 4])
def test_rows_alone_equal_rows_in_a_batch(engine: str, t: int) -> None:
    x, w, b = _inputs()
    chunks = KS.split_weight(w, t)
    batch = KS.ksplit_linear(x, chunks, b, t=t, engine=engine)
    for start, m in ((0, 1), (5, 17), (M - 3, 3)):
        alone = KS.ksplit_linear(x[start:start + m].clone(), chunks, b, t=t, engine=engine)
        assert torch.equal(alone, batch[start:start + m]), f"rows {start}..{start + m} t={t} {engine}"


@pytest.mark.parametrize("engine", ENGINES)
def test_the_tree_order_is_fixed_and_matters(engine: str) -> None:
    """Chunk products 2^25, 1, −2^25, 1 (one nonzero column per chunk): the pairwise tree gives
    (2^25 + 1) + (−2^25 + 1) = 2^25 − 2^25 = 0 in FP32 (each +1 is lost), a left chain gives 1."""
    x = torch.zeros(1, K)
    chunk = K // 4
    for j, v in enumerate((2.0**25, 1.0, -(2.0**25), 1.0)):
        x[0, j * chunk] = v
    w = torch.ones(1, K)
    parts = [KS.chunk_product(x[:, a:c], wc, engine=engine, config=KS.layer_config(1, K, torch.float32))
             for (a, c), wc in zip(KS.chunk_bounds(K, 4), KS.split_weight(w, 4))]
    left_chain = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    y = KS.ksplit_linear(x, w, None, t=4, engine=engine)
    assert float(left_chain) == 1.0 and float(y) == 0.0
    assert torch.equal(y, KS.tree_sum(parts))


def test_bad_splits_are_refused() -> None:
    x, w, b = _inputs()
    with pytest.raises(ValueError, match="t = 3 does not divide K = 128"):
        KS.ksplit_linear(x, w, b, t=3, engine="cpu")
    with pytest.raises(ValueError, match="positive int"):
        KS.ksplit_linear(x, w, b, t=0, engine="cpu")
    with pytest.raises(ValueError, match="not a multiple of the GEMM's K step 16"):
        KS.ksplit_linear(x, w, b, t=16, engine="triton")
    with pytest.raises(ValueError, match="expected 2 weight chunks"):
        KS.ksplit_linear(x, KS.split_weight(w, 4), b, t=2, engine="cpu")
    with pytest.raises(ValueError, match="runs torch.float32"):
        KS.ksplit_linear(x.bfloat16(), w.bfloat16(), None, t=2, engine="cpu")


@interp
def test_gemm_fwd_out_dtype_keeps_the_default_bytes_and_refuses_others() -> None:
    x, w, b = _inputs()
    y = G.gemm_fwd(x, w, b)[0]
    assert torch.equal(G.gemm_fwd(x, w, b, out_dtype=torch.float32)[0], y)
    with pytest.raises(ValueError, match="out_dtype must be None"):
        G.gemm_fwd(x, w, b, out_dtype=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_bf16_partials_are_fp32_and_t1_is_the_unsplit_bytes() -> None:
    target = Target("cuda", torch.bfloat16)
    skip_unless_compiled(target)
    x, w, b = (target.put(v) for v in bench.layer_inputs(3072, 3072, 300, torch.float32, "cpu"))
    cfg = KS.layer_config(3072, 3072, torch.bfloat16)
    assert KS.chunk_product(x[:, :1536], w[:, :1536].contiguous(), engine="triton", config=cfg).dtype == torch.float32
    assert torch.equal(KS.ksplit_linear(x, w, b, t=1), G.gemm_fwd(x, w, b)[0])
    rows = bench.bytes_case("attn_out", 3072, 3072, 300, "image", torch.bfloat16, (1, 2, 4), "cuda")
    assert rows[0]["differing"] == 0 and all(r["tp_shares_equal"] for r in rows)


@interp
def test_bench_sections_run_at_tiny_shapes_and_render(tmp_path: Path) -> None:
    splits = (1, 2, 4)
    acc = bench.accuracy_case("tiny", N, K, M, "image", torch.float32, splits, "cpu")
    byt = bench.bytes_case("tiny", N, K, M, "image", torch.float32, splits, "cpu")
    inv = bench.invariance_case("tiny", N, K, torch.float32, splits, "cpu", big_m=48, ms=(1, 11))
    assert all(a["pass"] and a["ratio"] <= 1.0 for a in acc), acc
    assert byt[0]["differing"] == 0 and all(r["tp_shares_equal"] for r in byt)
    assert all(r["pass"] and r["checked"] == 6 for r in inv), inv
    speed = [{"layer": "tiny", "rows": "37 (image)", "M": M, "N": N, "K": K, "dtype": "float32", "variant": v, "t": t,
              "ms": 0.5, "graph_ms": g, "tflops": None if t == 4 else 1.0, "vs_cublas": 1.0, "vs_unsplit": 1.0}
             for v, t, g in (("cuBLAS F.linear", None, 0.4), ("one rank's share", 2, None), ("tree + bias + cast", 4, 0.1))]
    comm = [dict(bench.communication(M, N, K, t, 4), layer="tiny", rows="37 (image)", dtype="float32") for t in splits]
    report = {"env": {"gpu": "none", "commit": "abc"}, "accuracy": acc, "bytes": byt, "invariance": inv, "speed": speed,
              "communication": comm, "errors": ["speed tiny: skipped"], "wall_s": 3.0}
    text = bench.render(report)
    assert f"Accuracy vs FP64 ({len(acc)}/{len(acc)} pass)" in text
    assert "| tiny | 37 (image) | float32 | 1 | 0 |" in text
    assert "| tiny | 37 (image) | float32 | one rank's share | 2 | 0.5000 | — | 1.0 |" in text
    assert "- speed tiny: skipped" in text and "Wall time 3 s." in text


def test_communication_counts() -> None:
    c = bench.communication(4224, 3072, 12288, 4, 2)
    assert c["row_parallel_gather_fp32"] == 3 * 4224 * 3072 * 4
    assert c["allgather_output"] == 0.75 * 4224 * 3072 * 2
    assert c["allgather_input_and_output"] == 0.75 * 4224 * (3072 + 12288) * 2
    assert all(v == 0 for key, v in bench.communication(256, 3072, 3072, 1, 2).items()
               if key not in ("t", "M", "N", "K", "elem_bytes"))


def test_cli_runs_the_ksplit_bench(tmp_path: Path, monkeypatch) -> None:
    from mmdit_strict.cli import main as cli

    seen = []
    monkeypatch.setattr(cli, "_require_gpu", lambda what: None)
    monkeypatch.setattr(bench, "main", lambda argv: seen.append(list(argv)) or 0)
    assert cli.main(["bench", "ksplit", "--out", str(tmp_path)]) == 0
    assert seen == [["--out", str(tmp_path)]]
