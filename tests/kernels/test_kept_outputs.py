"""``KeptOutputs`` (``kernels/kept_outputs.py``): a slot's first call computes and keeps, the next takes it back."""

from __future__ import annotations

from mmdit_strict.kernels.kept_outputs import KeptOutputs


def test_a_slot_is_computed_once_then_taken_back_once() -> None:
    kept = KeptOutputs()
    calls: list[str] = []

    def compute(tag: str):
        return lambda: calls.append(tag) or object()

    free = kept.run(compute("free"))  # no slot named: computed, nothing kept
    assert len(kept) == 0 and calls == ["free"] and free is not None
    with kept.at("block0.joint"):
        first = kept.run(compute("forward"))
        with kept.at("block1.joint"):  # slots nest and come back
            other = kept.run(compute("other"))
        assert kept.slot == "block0.joint"
        again = kept.run(compute("recompute"))
        third = kept.run(compute("a second backward"))
    assert kept.slot is None
    assert again is first and third is not first and other is not first
    assert calls == ["free", "forward", "other", "a second backward"]
    assert (kept.kept, kept.reused, len(kept)) == (3, 1, 2)  # block0's third call kept its result again
