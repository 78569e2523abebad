"""The built-in recipe's crop windows computed with numpy (an epoch the decoded tier serves whole)
are DALI's, bit for bit, and follow torchvision's rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nvidia.dali import fn, pipeline_def

from coordl import draws
from coordl.prep import windows
from coordl.prep.planned import SampleRandom
from test_resume import _reference_window

EDGES = [(1, 1), (1, 5000), (5000, 1), (3, 4), (4, 3), (300, 400), (400, 300), (224, 224), (350, 400), (2, 3)]
SCALES = [(0.08, 1.0), (0.5, 0.5), (0.9, 1.0), (0.01, 0.02)]
RATIOS = [(3 / 4, 4 / 3), (1.0, 1.0), (2.0, 3.0), (0.2, 5.0)]


def dali_windows(shapes, planned, ratio):
    hwc = np.array([(h, w, 3) for h, w in shapes], dtype=np.int64)

    @pipeline_def(batch_size=len(shapes), num_threads=1, device_id=None)
    def pipe():
        shape, u = fn.external_source(source=lambda: (hwc, planned), num_outputs=2, batch=True)
        return SampleRandom(u).planned_crop_window(shape, ratio)

    p = pipe()
    p.build()
    anchors, sizes = p.run()
    return np.stack([np.array(a) for a in anchors]), np.stack([np.array(s) for s in sizes])


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_numpy_windows_are_dalis_bit_for_bit(scale, ratio):
    rng = np.random.default_rng(hash((scale, ratio)) % 2**32)
    shapes = EDGES + [tuple(int(v) for v in rng.integers(1, 5000, 2)) for _ in range(500)]
    shapes += [(h, int(h * r)) for h in (300, 375, 480, 3000) for r in (ratio[0], ratio[1], 1 / ratio[0], 1 / ratio[1])]
    shapes = [(max(1, h), max(1, w)) for h, w in shapes]
    u = draws.uniforms(7, 3, np.arange(len(shapes)), windows.COLUMNS)
    planned = windows.shape_free(u, scale, ratio)
    want_anchor, want_size = dali_windows(shapes, planned, ratio)
    h, w = np.array(shapes).T
    anchor, size = windows.crop_windows(h, w, planned, ratio)
    assert anchor.dtype == size.dtype == np.float32
    bad = np.flatnonzero((anchor != want_anchor).any(axis=1) | (size != want_size).any(axis=1))
    assert not len(bad), [(shapes[k], anchor[k], want_anchor[k], size[k], want_size[k]) for k in bad[:5]]


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 5000), st.integers(1, 5000)), min_size=1, max_size=64),
    seed=st.integers(0, 2**32),
    scale=st.sampled_from(SCALES[:3]),
    ratio=st.sampled_from(RATIOS[:3]),
)
def test_numpy_windows_fit_the_image_and_follow_torchvisions_rule(shapes, seed, scale, ratio):
    u = draws.uniforms(seed, 0, np.arange(len(shapes)), windows.COLUMNS)
    h, w = np.array(shapes).T
    anchor, size = windows.crop_windows(h, w, windows.shape_free(u, scale, ratio), ratio)
    for k, (hk, wk) in enumerate(shapes):
        (x, y), (cw, ch) = anchor[k], size[k]
        assert 1 <= cw <= wk and 1 <= ch <= hk and 0 <= x <= wk - cw and 0 <= y <= hk - ch
        want = _reference_window(hk, wk, u[k].astype(np.float64), scale, ratio)
        # float32 against float64: a side or corner may round the other way, by one pixel.
        assert np.allclose((x, y, cw, ch), want, atol=1.0), ((hk, wk), (x, y, cw, ch), want)


def test_flips_follow_the_last_draw():
    u = draws.uniforms(1, 2, np.arange(1000), windows.COLUMNS)
    f = windows.flips(windows.shape_free(u, (0.08, 1.0), (0.75, 4 / 3)), 0.5)
    assert f.dtype == np.int32 and set(np.unique(f)) == {0, 1}
    assert np.array_equal(f, (u[:, -1] < 0.5).astype(np.int32))
    assert not windows.flips(u, 0.0).any() and windows.flips(u, 1.0).all()


@pytest.mark.parametrize("p", [0.5, 0.3, 0.7, 1 / 3, 0.9999999])
def test_numpy_flips_are_dalis(p):
    u = draws.uniforms(5, 1, np.arange(4096), windows.COLUMNS)
    # Draws at the edges of p, where float32 and float64 comparisons could part.
    edge = np.float32(p)
    u[:3, -1] = [edge, np.nextafter(edge, np.float32(0)), np.nextafter(edge, np.float32(1))]
    u[:3, -1] = np.floor(u[:3, -1] * 2**24) / 2**24  # draws are multiples of 2**-24

    @pipeline_def(batch_size=len(u), num_threads=1, device_id=None)
    def pipe():
        (draws_in,) = fn.external_source(source=lambda: (u,), num_outputs=1, batch=True)
        random = SampleRandom(draws_in)
        random.used = windows.COLUMNS - 1
        return random.coin_flip(p)

    pipe_ = pipe()
    pipe_.build()
    (out,) = pipe_.run()
    assert np.array_equal(np.array([np.array(x) for x in out]).reshape(-1), windows.flips(u, p))
