"""Host cost of the execution state on the strict forward's hot path, per call, on the CPU.

The strict model binds a GEMM stream around every product (a few hundred binds per forward) and every
operator call reads the runtime, the capture / fault fields and, on cache hits, the keep-alive list. This
times those with the public helpers, so the same script runs on a tree before and after a change:

    PYTHONPATH=<tree> python benchmarks/context_bind.py [--rounds 40]

Each figure is the best of ``--rounds`` rounds of ``--number`` calls (ns per call).
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable


def cases() -> dict[str, Callable[[], None]]:
    from mmdit_strict.kernels.keepalive import retain
    from mmdit_strict.kernels.runtime import current_runtime
    from mmdit_strict.kernels.streams import current_gemm_stream, gemm_stream
    from mmdit_strict.model.strict import instrumented

    def bind_other() -> None:
        with gemm_stream("text"):
            pass

    def bind_in_force() -> None:
        with gemm_stream("image"):
            pass

    def reads() -> None:
        current_runtime()
        current_gemm_stream()
        retain(None)
        instrumented()

    return {"bind other stream": bind_other, "bind stream in force": bind_in_force, "4 reads": reads}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--number", type=int, default=20_000)
    args = parser.parse_args(argv)
    from mmdit_strict.kernels.runtime import runtime_mode

    best: dict[str, float] = {}
    with runtime_mode("strict"):
        todo = cases()
        for _ in range(args.rounds):  # interleaved, so a busy machine slows every case alike
            for name, fn in todo.items():
                t = timeit.timeit(fn, number=args.number) / args.number
                best[name] = min(best.get(name, t), t)
    for name, t in best.items():
        print(f"{name:22s} {t * 1e9:7.0f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
