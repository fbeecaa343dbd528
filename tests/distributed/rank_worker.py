"""A torchrun worker for the tests: the ``mmdit-strict`` CLI with a rank-dependent twist.

Launched as ``torchrun ... tests/distributed/rank_worker.py <command> <overrides>``. The twists
simulate faults of a real job without any test hook in the package:

* ``MMDIT_TEST_RANK<r>_ARGS="key=value ..."`` appends overrides on rank ``r`` only (a misconfigured rank);
* ``MMDIT_TEST_DIE="<rank>:<step>"`` makes that rank's process end abruptly (``os._exit(3)``) when its
  rollout reaches that step (a rank that dies).
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    rank = int(os.environ["RANK"])
    argv = sys.argv[1:] + os.environ.get(f"MMDIT_TEST_RANK{rank}_ARGS", "").split()
    die = os.environ.get("MMDIT_TEST_DIE")
    if die:
        die_rank, die_step = (int(v) for v in die.split(":"))
        if rank == die_rank:
            import mmdit_strict.trajectories.rollout as rollout

            real = rollout.step_latents

            def dying(sampler, seed, v, x, sigmas, step, ids, prev_sample=None):  # type: ignore[no-untyped-def]
                if step == die_step:
                    os._exit(3)
                return real(sampler, seed, v, x, sigmas, step, ids, prev_sample)

            rollout.step_latents = dying
    from mmdit_strict.cli.main import main as cli

    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
