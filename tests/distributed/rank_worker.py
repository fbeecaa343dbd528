"""A torchrun worker for the tests: the ``mmdit-strict`` CLI with a rank-dependent twist.

Launched as ``torchrun ... tests/distributed/rank_worker.py <command> <overrides>``. The twists
simulate faults of a real job without any test hook in the package:

* ``MMDIT_TEST_RANK<r>_ARGS="key=value ..."`` appends overrides on rank ``r`` only (a misconfigured rank);
* ``MMDIT_TEST_DIE="<rank>:<step>"`` makes that rank's process end abruptly (``os._exit(3)``) when its
  rollout reaches that step (a rank that dies);
* ``MMDIT_TEST_DIE_TRAIN="<rank>:<n>"`` makes that rank end abruptly at its ``n``-th GRPO loss of a
  ``train`` run (mid-update: its micro-batch's forward ran, its backward never does).
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
    die_train = os.environ.get("MMDIT_TEST_DIE_TRAIN")
    if die_train:
        die_rank, die_call = (int(v) for v in die_train.split(":"))
        if rank == die_rank:
            import mmdit_strict.training.loop as loop

            real_loss = loop.grpo_loss
            calls = [0]

            def dying_loss(*args, **kwargs):  # type: ignore[no-untyped-def]
                calls[0] += 1
                if calls[0] == die_call:
                    os._exit(3)
                return real_loss(*args, **kwargs)

            loop.grpo_loss = dying_loss
    from mmdit_strict.cli.main import main as cli

    return cli(argv)


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # as `python -m mmdit_strict` does for a rank: no interpreter finalization after the job
