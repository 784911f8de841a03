"""Every strategy's step changes every weight exactly as one device does on the same batch."""

import numpy as np
import pytest

from tests.helpers import max_update_difference, one_step
from tf_multigpu.data import load_source

# fp32 sums of the same products in a different order (per-replica partial sums, then the
# all-reduce) differ by a few ulps; relative to the update that is ~1e-7..1e-6. 1e-5 leaves
# headroom for that and nothing else: a wrong loss scale (x N) or a missed all-reduce is O(1).
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def digits_batch():
    source = load_source("digits")
    images, labels = next(iter(source.train_records().batch(64)))
    return source, source.preprocess(images), labels


@pytest.fixture(scope="module")
def single_step(digits_batch):
    from tests.conftest import DEVICES
    source, images, labels = digits_batch
    return one_step("single", DEVICES, source, images, labels)


@pytest.mark.parametrize("num_devices", [1, 2, 4])
def test_data_parallel_step_equals_one_device(num_devices, digits_batch, single_step, devices):
    source, images, labels = digits_batch
    before, single = single_step
    before_d, data = one_step("data", devices[:num_devices], source, images, labels)
    for a, b in zip(before, before_d):
        np.testing.assert_array_equal(a, b)   # same seed -> same initial weights
    assert max_update_difference(before, data, single) <= TOLERANCE


def test_two_steps_with_momentum_match(digits_batch, devices):
    """Momentum and weight decay state stays in step too, not just the first gradient."""
    source, images, labels = digits_batch
    before, single = one_step("single", devices, source, images, labels, steps=2)
    _, data = one_step("data", devices[:4], source, images, labels, steps=2)
    assert max_update_difference(before, data, single) <= TOLERANCE


def test_tolerance_catches_a_wrong_loss_scale(digits_batch, devices):
    """The check can fail: averaging the loss per replica instead of over the global batch
    makes 2 replicas' update twice one device's, the same as doubling the learning rate."""
    source, images, labels = digits_batch
    before, single = one_step("single", devices, source, images, labels)
    _, doubled = one_step("single", devices, source, images, labels, learning_rate=0.2)
    assert max_update_difference(before, doubled, single) > 0.5
