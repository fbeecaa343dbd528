"""figures: PNGs written whole or not at all, and the figure closed either way."""

from __future__ import annotations

import pytest

from mmdit_strict.figures import pyplot, save_png


def test_save_png_writes_a_png_and_closes_the_figure(tmp_path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = save_png(fig, tmp_path / "made" / "line.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number)
    assert [p.name for p in path.parent.iterdir()] == ["line.png"]  # no temporary file left beside it


def test_a_failed_save_keeps_the_old_file_and_closes_the_figure(tmp_path) -> None:
    plt = pyplot()
    old = tmp_path / "curve.png"
    old.write_bytes(b"the previous figure")
    fig, ax = plt.subplots()

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    fig.savefig = broken
    with pytest.raises(RuntimeError, match="disk full"):
        save_png(fig, old)
    assert old.read_bytes() == b"the previous figure"
    assert [p.name for p in tmp_path.iterdir()] == ["curve.png"]
    assert not plt.fignum_exists(fig.number)
