import sys

from .cli.main import main

rc = main()
from .distributed import launched  # noqa: E402

if launched():
    # A torchrun rank leaves without the interpreter's finalization: its process group is destroyed and every
    # file is written by now, but gloo's worker threads can still abort the teardown ("terminate called without
    # an active exception", exit -6), seen on 2-core CI machines (docs/distributed.md, "Launch").
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc if isinstance(rc, int) else 1)
sys.exit(rc)
