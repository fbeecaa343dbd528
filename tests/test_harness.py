"""The test harness itself: a gradient that an implementation drops is a failure, never zeros.

(The harness's byte and invariance checks are exercised on defects in
tests/kernels/test_cpu_strict_ops.py::test_harness_detects_failures.)
"""

from __future__ import annotations

import pytest
import torch

from mmdit_strict.tolerances import Tolerance
from tests.harness import (
    MissingGradientError,
    check_grad_accuracy,
    check_param_grad_fold,
    generator,
    randn,
    run_with_grads,
)

TOL = Tolerance(rtol=1e-5, atol=1e-5, reason="harness self-test")


def _xy():
    gen = generator(4)
    return randn(3, 5, gen=gen), randn(3, 5, gen=gen)


def test_run_with_grads_raises_on_a_dropped_gradient() -> None:
    x, y = _xy()
    with pytest.raises(MissingGradientError, match=r"inputs \[1\] received no gradient"):
        run_with_grads(lambda a, b: a * b.detach(), [x, y], torch.ones(3, 5))
    # nothing differentiable reaches the output at all
    with pytest.raises(MissingGradientError, match=r"inputs \[0, 1\]"):
        run_with_grads(lambda a, b: (a * b).detach(), [x, y], torch.ones(3, 5))
    # an explicit opt-in returns None (never zeros) for the caller to compare
    _, grads = run_with_grads(lambda a, b: a * b.detach(), [x, y], torch.ones(3, 5), allow_missing=True)
    assert grads[1] is None and torch.equal(grads[0], y)


def test_grad_accuracy_fails_when_the_implementation_drops_a_gradient() -> None:
    """The reference's gradient of ``y`` is 1e-9·dout, far below atol: read as zeros, the dropped
    gradient would have passed the bound."""
    x, y = _xy()
    with pytest.raises(AssertionError, match="grad of input 1: the implementation produced no gradient"):
        check_grad_accuracy(lambda a, b: a + 1e-9 * b.detach(), lambda a, b: a + 1e-9 * b, [x, y], TOL, what="dropped")
    with pytest.raises(AssertionError, match="grad of input 1: the reference produced no gradient"):
        check_grad_accuracy(lambda a, b: a + 1e-9 * b, lambda a, b: a + 1e-9 * b.detach(), [x, y], TOL, what="dropped ref")


def test_grad_accuracy_accepts_an_input_neither_side_differentiates() -> None:
    x, y = _xy()
    report = check_grad_accuracy(lambda a, b: a * 2.0 + 0.0 * b.detach(), lambda a, b: a * 2.0 + 0.0 * b.detach(),
                                 [x, y], TOL, what="unused on both sides")
    assert report["grad1"] == "no gradient on either side"


def test_param_grad_fold_fails_when_a_parameter_gets_no_gradient() -> None:
    gen = generator(5)
    items = [randn(n, 4, gen=gen) for n in (2, 3)]
    gouts = [randn(n, 4, gen=gen) for n in (2, 3)]
    w, unused = randn(4, 4, gen=gen), randn(4, gen=gen)

    def fn(batch, params):
        return [t @ params[0].T + params[1].detach() for t in batch]

    with pytest.raises(MissingGradientError, match=r"params \[1\] received no gradient"):
        check_param_grad_fold(fn, items, [w, unused], gouts, what="bias detached")
