"""Data sets and the pipeline: real digits, seeded resumable order, per-replica slices, TFDS."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tf_multigpu.data import load_source, pipeline
from tf_multigpu.data.pipeline import steps_per_epoch, train_dataset
from tf_multigpu.errors import UsageError
from tf_multigpu.parallel import make_parallelism


@pytest.fixture(scope="module")
def digits():
    return load_source("digits")


def _labels(ds, n):
    return np.concatenate([y.numpy() for _, y in ds.take(n)])


def test_digits_are_real_and_split(digits):
    assert (digits.num_train, digits.num_test) == (1437, 360)
    images, labels = next(iter(digits.train_records().batch(2000)))
    assert images.shape == (1437, 8, 8, 1) and images.dtype == tf.uint8
    assert int(tf.reduce_max(images)) == 16
    assert sorted(set(labels.numpy())) == list(range(10))
    x = digits.preprocess(images)
    assert float(tf.reduce_min(x)) == -1.0 and float(tf.reduce_max(x)) == 1.0


def test_same_seed_same_batches_other_seed_other_order(digits):
    a = _labels(train_dataset(digits, seed=3, global_batch=64, batch_size=64), 5)
    b = _labels(train_dataset(digits, seed=3, global_batch=64, batch_size=64), 5)
    c = _labels(train_dataset(digits, seed=4, global_batch=64, batch_size=64), 5)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_epochs_differ_and_cover_the_split(digits):
    per_epoch = steps_per_epoch(digits, 64)
    assert per_epoch == 22
    ds = train_dataset(digits, seed=0, global_batch=64, batch_size=64)
    e0, e1 = _labels(ds, 2 * per_epoch).reshape(2, -1)
    assert (e0 != e1).any()
    # each epoch is a permutation of the split (less the ragged tail)
    counts = np.bincount(e0, minlength=10)
    assert counts.sum() == per_epoch * 64 and counts.min() > 100


def test_resume_gives_the_batches_an_uninterrupted_run_sees(digits):
    whole = list(train_dataset(digits, seed=1, global_batch=32, batch_size=32).take(60))
    resumed = list(train_dataset(digits, seed=1, global_batch=32, batch_size=32, start_step=37).take(23))
    for (xa, ya), (xb, yb) in zip(whole[37:], resumed):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)


@pytest.mark.parametrize("num_devices", [2, 4])
def test_replicas_get_consecutive_slices_of_the_global_batch(digits, devices, num_devices):
    par = make_parallelism("data", devices[:num_devices], 64)
    dist = iter(par.distribute(lambda b: train_dataset(digits, seed=0, global_batch=64, batch_size=b)))
    whole = iter(train_dataset(digits, seed=0, global_batch=64, batch_size=64))
    for _ in range(3):
        _, labels = next(dist)
        _, y_global = next(whole)
        y_parts = np.concatenate([y.numpy() for y in par.strategy.experimental_local_results(labels)])
        np.testing.assert_array_equal(y_parts, y_global)


@pytest.mark.parametrize("name, kwargs", [("digits", {}), ("synthetic", {"image_size": 8})])
@pytest.mark.parametrize("global_batch, batch_size, start_step, shard", [
    (256, 64, 0, (0, 1)),     # per-replica pieces of 4 replicas, several epochs
    (256, 256, 7, (0, 1)),    # whole global batches, resumed mid-epoch (digits: 5 steps an epoch)
    (64, 16, 30, (1, 2)),     # the second of 2 workers, resumed in a later epoch
    (96, 32, 3, (2, 3)),      # 3 workers: a worker's 32 rows are one batch
    (64, 24, 0, (0, 2)),      # a worker's 32 rows do not divide into its batches of 24
])
def test_whole_batch_path_gives_the_per_element_paths_batches(name, kwargs, global_batch, batch_size,
                                                              start_step, shard):
    source = load_source(name, **kwargs)
    assert not source.train_decode                   # takes pipeline._whole_batches
    assert bool(source.batch_decode) == (name == "digits")   # digits: decoded a batch at a time
    # An augmentation that is the identity sends the same source down the per-element path.
    per_element = dataclasses.replace(source, train_decode=lambda record, key: source.decode(record))
    args = dict(seed=5, global_batch=global_batch, batch_size=batch_size, start_step=start_step, shard=shard)
    fast, general = train_dataset(source, **args), train_dataset(per_element, **args)
    assert fast.element_spec == general.element_spec
    steps = 3 * steps_per_epoch(source, global_batch) if name == "digits" else 40
    count = steps * global_batch // shard[1] // batch_size
    for (xa, ya), (xb, yb) in zip(fast.take(count), general.take(count), strict=True):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)


def test_test_split_is_padded_with_zero_weight_rows(digits):
    batches = list(pipeline.test_dataset(digits, global_batch=64, batch_size=64))
    assert len(batches) == 6                       # ceil(360 / 64)
    weights = np.concatenate([w.numpy() for _, _, w in batches])
    assert weights.sum() == 360 and (weights[360:] == 0).all()


def test_batch_larger_than_the_data_is_refused(digits):
    with pytest.raises(UsageError, match="--batch_size<=1437"):
        steps_per_epoch(digits, 4096)


def test_synthetic_is_deterministic_imagenet_shaped():
    source = load_source("synthetic", image_size=32)
    assert source.image_shape == (32, 32, 3) and source.num_classes == 1000
    a = next(iter(train_dataset(source, seed=0, global_batch=8, batch_size=8)))
    b = next(iter(train_dataset(source, seed=0, global_batch=8, batch_size=8)))
    np.testing.assert_array_equal(a[0], b[0])
    assert a[0].shape == (8, 32, 32, 3) and a[0].dtype == tf.float32


def test_tfds_cifar10_offline():
    with tfds.testing.mock_data(num_examples=40):
        source = load_source("tfds:cifar10")
        assert source.image_shape == (32, 32, 3) and source.num_classes == 10
        assert source.num_train == 40
        x, y = next(iter(train_dataset(source, seed=0, global_batch=16, batch_size=8)))
        assert x.shape == (8, 32, 32, 3) and y.dtype == tf.int32


def test_tfds_imagenet_resized():
    with tfds.testing.mock_data(num_examples=16):
        source = load_source("tfds:imagenet2012", image_size=64)
        assert source.image_shape == (64, 64, 3) and source.num_classes == 1000
        x, _, w = next(iter(pipeline.test_dataset(source, global_batch=8, batch_size=8)))
        assert x.shape == (8, 64, 64, 3)


@pytest.mark.parametrize("name, kwargs, needle", [
    ("mnist_in_a_hat", {}, "choose one of digits, synthetic, tfds:NAME"),
    ("tfds:no_such_set_xyz", {}, "TFDS has no such data set"),
    ("tfds:cifar1", {}, "TFDS has no such data set; did you mean tfds:cifar10?"),
    ("tfds:cifar10:9.9.9", {}, "TFDS cannot load it (Failed to construct"),   # not "no such data set"
    ("tfds:cifar10", {"data_dir": "/tmp"}, "is not prepared in /tmp"),
    ("digits", {"image_size": 32}, "--image_size does not apply"),
])
def test_bad_data_sets_name_the_fix(name, kwargs, needle):
    with pytest.raises(UsageError) as e:
        load_source(name, **kwargs)
    assert needle in str(e.value)
