"""Launch candidates of the row kernels (LayerNorm modulation, QK norm / RoPE), for benchmarks and the byte tests.

The product launches are the frozen tables of the kernel modules (``norms.LN_CONFIGS``, ``rope.QK_FWD_CONFIGS``,
``rope.QK_BWD_CONFIGS``). The candidates below are other launches of the same kernels: none changes the arithmetic,
so each must give the reference launch's bytes (``tests/kernels/test_triton_norms.py`` and ``test_triton_rope.py``
check it; ``benchmarks/norms_tune.py`` times them). A candidate reaches a kernel only as the explicit ``config=``
argument of its launcher (or ``config=`` / ``fwd_config=`` / ``bwd_config=`` of the public operator).

What each candidate measured: experiments/norms/.
"""

from __future__ import annotations

from mmdit_strict.kernels.triton.norms import LN_CONFIGS, LnConfig
from mmdit_strict.kernels.triton.rope import QK_BWD_CONFIGS, QK_FWD_CONFIGS, QkBwdConfig, QkFwdConfig

# The reference each candidate's bytes are compared with: 4-row forward programs, no read-ahead.
LN_REFERENCE = LnConfig(fwd_rows=4, fwd_ahead=0)
LN_CANDIDATES = tuple(dict.fromkeys([
    LN_REFERENCE, *LN_CONFIGS.values(), LnConfig(fwd_rows=1, fwd_ahead=0, bwd_ahead=0, bwd_stages=3),
    LnConfig(fwd_rows=4, fwd_ahead=1, fwd_maxnreg=80, bwd_ahead=0),
    *(LnConfig(fwd_rows=r, fwd_ahead=a, fwd_maxnreg=m, bwd_ahead=ba, bwd_maxnreg=bm)
      for r, a, m, ba, bm in ((4, 1, None, 1, None), (1, 0, None, 0, None), (1, 1, None, 1, 128), (8, 1, None, 0, None),
                              (2, 1, 80, 0, None), (1, 0, 64, 0, None), (8, 0, 64, 1, 128))),
    # the row loops pipelined through shared memory
    *(LnConfig(fwd_rows=r, fwd_ahead=0, fwd_maxnreg=m, fwd_stages=fs, bwd_ahead=0, bwd_maxnreg=bm, bwd_stages=bs)
      for r, m, fs, bm, bs in ((4, 80, 2, None, 2), (8, 80, 3, None, 3), (8, None, 3, 128, 4), (16, 80, 4, None, 4),
                               (16, None, 6, None, 6))),
]))

# QK backward: three tokens read ahead is the reference.
QK_BWD_REFERENCE = QkBwdConfig(ahead=3)
QK_BWD_CANDIDATES = tuple(dict.fromkeys([
    QK_BWD_REFERENCE, *QK_BWD_CONFIGS.values(), QkBwdConfig(1), QkBwdConfig(2), QkBwdConfig(1, 128),
    # the token loop pipelined through shared memory
    QkBwdConfig(0, None, 2), QkBwdConfig(0, None, 3), QkBwdConfig(0, 128, 4),
]))

# QK forward: one token per program, one head tile is the reference.
QK_FWD_REFERENCE = QkFwdConfig()
QK_FWD_CANDIDATES = tuple(dict.fromkeys([
    QK_FWD_REFERENCE, *QK_FWD_CONFIGS.values(), QkFwdConfig(4, 2), QkFwdConfig(8, 3), QkFwdConfig(16, 3),
    QkFwdConfig(16, 4), QkFwdConfig(split_heads=True), QkFwdConfig(4, 2, split_heads=True),
    QkFwdConfig(8, 3, split_heads=True),
]))
