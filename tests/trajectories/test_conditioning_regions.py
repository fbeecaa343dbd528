"""Which tokens a drifting row belongs to (localize._place): the noisy latent, text, a sample vector, or the edit
conditioning — and, for a sample with several input images, which image and the row within it."""

from __future__ import annotations

from mmdit_strict.trajectories.localize import OperatorDrift, _place


def _drift(row: int, key: str = "block0.img.mlp_down_gemm", stream: str = "img") -> OperatorDrift:
    return OperatorDrift(branch="cond", key=key, operator=key.split(".")[-1], block=0, stream=stream, logical_row=row,
                         element=0, row_width=8, max_abs=1.0, max_ulp=1, rows_differing=1, rows_total=60)


def test_rows_past_the_noisy_grid_name_their_input_image_and_row() -> None:
    images = [[2, 3], [4, 4]]  # 6 then 16 conditioning tokens after a 4x4 noisy grid (16 tokens)
    for row, want in [(15, ("noisy latent", 15, 0, 1)), (16, ("conditioning image", 0, 0, 2)),
                      (21, ("conditioning image", 5, 0, 2)), (22, ("conditioning image", 0, 1, 2)),
                      (37, ("conditioning image", 15, 1, 2))]:
        d = _drift(row)
        _place(d, (4, 4), images)
        assert (d.region, d.region_row, d.region_image, d.region_images) == want, row


def test_one_image_samples_and_other_regions_keep_their_names() -> None:
    d = _drift(20)
    _place(d, (4, 4))  # one-image artifacts record no per-image grids
    assert (d.region, d.region_row, d.region_image, d.region_images) == ("conditioning image", 4, 0, 1)
    t = _drift(3, "block0.txt.mlp_down_gemm", "txt")
    _place(t, (4, 4), [[2, 3]])
    assert t.region == "text" and t.region_row == 3
