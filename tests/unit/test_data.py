"""Datasets and the per-rank sampler."""

import numpy as np
import pytest

from meta_dist.train import DistributedSampler, load_npz, synthetic_classification


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_rank_parts_are_disjoint_and_make_the_global_batch(size):
    samplers = [DistributedSampler(100, 12, r, size, seed=5) for r in range(size)]
    for epoch in range(3):
        parts = [list(s.epoch(epoch)) for s in samplers]
        assert all(len(p) == 100 // 12 for p in parts)  # every rank: the same number of steps
        one = list(DistributedSampler(100, 12, 0, 1, seed=5).epoch(epoch))
        for step in range(len(one)):
            np.testing.assert_array_equal(np.concatenate([p[step] for p in parts]), one[step])
    e0, e1 = (np.concatenate(list(samplers[0].epoch(e))) for e in (0, 1))
    assert not np.array_equal(e0, e1)  # a new order each epoch


def test_sampler_errors_and_max_steps():
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        DistributedSampler(100, 10, 0, 3)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        DistributedSampler(5, 8, 0, 2)
    assert DistributedSampler(100, 10, 0, 2, max_steps=3).steps_per_epoch == 3
    ordered = list(DistributedSampler(8, 4, 1, 2, shuffle=False).epoch(0))
    np.testing.assert_array_equal(ordered[0], [2, 3])


def test_synthetic_data_is_deterministic_and_balanced():
    x, y = synthetic_classification(2000, (3, 4, 4), 10, seed=1)
    x2, y2 = synthetic_classification(2000, (3, 4, 4), 10, seed=1)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert x.shape == (2000, 3, 4, 4) and x.dtype == np.float32 and y.dtype == np.int64
    counts = np.bincount(y, minlength=10)
    assert counts.min() > 100  # standardized teacher scores: no class takes everything
    _, y_teacher = synthetic_classification(50, (2,), 2, seed=0, teacher=lambda a: a)
    np.testing.assert_array_equal(y_teacher, np.argmax((lambda s: (s - s.mean(0)) / s.std(0))(
        synthetic_classification(50, (2,), 2, seed=0)[0].astype(np.float64)), axis=1))


def test_load_npz(tmp_path):
    good = tmp_path / "good.npz"
    np.savez(good, x=np.ones((4, 2)), y=np.arange(4))
    x, y = load_npz(good)
    assert x.shape == (4, 2) and y.dtype == np.int64
    bad = tmp_path / "bad.npz"
    np.savez(bad, inputs=np.ones(3))
    with pytest.raises(ValueError, match=r"missing array\(s\) \['x', 'y'\]"):
        load_npz(bad)
    uneven = tmp_path / "uneven.npz"
    np.savez(uneven, x=np.ones((4, 2)), y=np.arange(3))
    with pytest.raises(ValueError, match="x has 4 samples"):
        load_npz(uneven)


def test_load_npz_names_samples_that_are_not_finite(tmp_path):
    """NaN in a data file stopped training at its first loss, with a traceback on every rank;
    it is a mistake in the data file: one message naming the file and the samples."""
    x = np.ones((5, 2, 2), np.float32)
    x[3, 1, 0], x[4, 0, 0] = np.nan, np.inf
    path = tmp_path / "nan.npz"
    np.savez(path, x=x, y=np.arange(5))
    with pytest.raises(ValueError, match=r"nan.npz: x holds NaN or inf in 2 of 5 samples \(the "
                                         r"first: sample 3\); expected finite inputs"):
        load_npz(path)
