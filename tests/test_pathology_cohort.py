"""benchmarks.pathology_cohort: the planted co-occurrence cohorts mean what they say."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.pathology_cohort import CohortConfig, directions, make_cohort


def _sites(bag, cfg, level):
    """How many patches carry A and B above ``level`` (projection on the pattern direction)."""
    d = directions(cfg)
    proj = bag.features.numpy() @ d[:2].T
    return (proj > level).sum(0)


def test_positive_bags_hold_both_patterns_and_negatives_at_most_one():
    cfg = CohortConfig(bag_size=400, strength=8.0, site_patches=15, decoys=0, negatives="single")
    bags = make_cohort(24, 3, cfg)
    assert [b.label for b in bags] == [1, 0] * 12
    assert all(b.features.shape == (400, 16) and b.coords.shape == (400, 2) for b in bags)
    for b in bags:
        a, bb = _sites(b, cfg, 5.0)  # noise and tissue stay far under 5 along A and B (orthogonal directions)
        if b.label:
            assert a >= 10 and bb >= 10
        else:
            assert min(a, bb) <= 2
    again = make_cohort(24, 3, cfg)
    assert all(np.array_equal(x.features.numpy(), y.features.numpy()) for x, y in zip(bags, again))
    assert not np.array_equal(make_cohort(2, 4, cfg)[0].features.numpy(), bags[0].features.numpy())


def test_decoys_are_weaker_sites_in_every_bag():
    cfg = CohortConfig(bag_size=400, strength=8.0, site_patches=15, decoys=2, negatives="mixed")
    for b in make_cohort(10, 5, cfg):
        strong = _sites(b, cfg, 6.0).sum()
        weak_or_strong = _sites(b, cfg, 2.5).sum()
        assert weak_or_strong - strong >= 2 * 15 - 8  # two half-strength sites (a few noisy patches either way)
    with pytest.raises(ValueError, match="negatives"):
        CohortConfig(negatives="none")
