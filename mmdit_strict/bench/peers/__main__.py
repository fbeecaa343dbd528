"""``python -m mmdit_strict.bench.peers``."""

from .main import main

raise SystemExit(main())
