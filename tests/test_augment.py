"""The paper's ImageNet recipe (--augment=paper): shorter side to 256, a random 224 window,
mirrored at random, for training; the centre 224 window for testing; seeded and stateless."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from numpy.lib.stride_tricks import sliding_window_view

from tf_multigpu.data import load_source, pipeline
from tf_multigpu.data.augment import paper_test, paper_train, resize_shorter


def _coordinates(height, width):
    """An image whose pixels say where they are: R = row, G = column % 256, B = column // 256."""
    y, x = np.mgrid[:height, :width]
    return tf.constant(np.stack([y, x % 256, x // 256], -1).astype(np.uint8))


def _window(crop):
    """(first row, first column, mirrored) of a crop of _coordinates."""
    rows, cols = crop[:, 0, 0].astype(int), crop[0, :, 1].astype(int) + 256 * crop[0, :, 2].astype(int)
    np.testing.assert_array_equal(rows, np.arange(rows[0], rows[0] + len(rows)))   # contiguous rows
    mirrored = cols[0] > cols[-1]
    cols = cols[::-1] if mirrored else cols
    np.testing.assert_array_equal(cols, np.arange(cols[0], cols[0] + len(cols)))   # contiguous columns
    return rows[0], cols[0], mirrored


def test_the_config_knows_the_augment_names():
    """The config refuses an unknown --augment before TensorFlow starts, from its own list."""
    from tf_multigpu.config.config import AUGMENTS
    from tf_multigpu.data.augment import AUGMENTS as SUPPORTED
    assert AUGMENTS == SUPPORTED


def test_training_crops_are_random_224_windows_mirrored_at_random_and_stateless():
    image = _coordinates(256, 300)           # shorter side already 256: the resize is the identity
    np.testing.assert_array_equal(resize_shorter(image, 256), image)
    windows = set()
    for position in range(40):
        key = tf.constant([7, position], tf.int64)
        crop = paper_train(image, key, 224).numpy()
        assert crop.shape == (224, 224, 3)
        np.testing.assert_array_equal(crop, paper_train(image, key, 224))   # same key, same crop
        top, left, mirrored = _window(crop)
        assert 0 <= top <= 256 - 224 and 0 <= left <= 300 - 224
        windows.add((top, left, mirrored))
    assert len(windows) > 30 and {m for _, _, m in windows} == {False, True}


def test_test_crop_is_the_centre_after_the_shorter_side_is_256():
    crop = paper_test(_coordinates(256, 300), 224).numpy()
    assert _window(crop) == (16, 38, False)
    assert paper_test(tf.zeros((500, 100, 3), tf.uint8), 224).shape == (224, 224, 3)   # 100 -> 256, 500 -> 1280
    assert resize_shorter(tf.zeros((500, 100, 3), tf.uint8), 256).shape == (1280, 256, 3)


@pytest.mark.slow
def test_imagenet2012_mock_goes_through_the_paper_recipe():
    with tfds.testing.mock_data(num_examples=8):   # random images of odd sizes, e.g. 47x17
        source = load_source("tfds:imagenet2012")
        assert source.image_shape == (224, 224, 3) and source.train_decode is not None   # paper: the default
        record, _ = next(iter(source.train_records()))
        resized = resize_shorter(tf.io.decode_image(record, channels=3), 256).numpy()
        assert min(resized.shape[:2]) == 256
        # testing: the centre window of the resized image
        top, left = (resized.shape[0] - 224) // 2, (resized.shape[1] - 224) // 2
        np.testing.assert_array_equal(source.decode(record), resized[top:top + 224, left:left + 224])
        # training: a 224 window of it (mirrored or not), a different one at another stream position
        found = set()
        for position in range(4):
            crop = source.decode_train(record, tf.constant([0, position], tf.int64)).numpy()
            found.add(_find_window(resized, crop))
        assert len(found) > 1
        x, y = next(iter(pipeline.train_dataset(source, seed=0, global_batch=8, batch_size=4)))
        assert x.shape == (4, 224, 224, 3) and x.dtype == tf.float32 and y.shape == (4,)
        x, _, w = next(iter(pipeline.test_dataset(source, global_batch=8, batch_size=8)))
        assert x.shape == (8, 224, 224, 3) and w.numpy().sum() == 8


def test_augment_none_keeps_the_plain_resize():
    with tfds.testing.mock_data(num_examples=4):
        source = load_source("tfds:imagenet2012", image_size=64, augment="none")
        assert source.image_shape == (64, 64, 3) and source.train_decode is None
        assert load_source("tfds:imagenet2012", image_size=64).train_decode is not None   # paper at 64: 73 -> 64


def _find_window(image, crop):
    """(top, left, mirrored) of the window of `image` that `crop` is; fails if there is none."""
    size = crop.shape[0]
    for mirrored, candidate in ((False, crop), (True, crop[:, ::-1])):
        corners = sliding_window_view(image, (8, 8, 3))[: image.shape[0] - size + 1, : image.shape[1] - size + 1, 0]
        for top, left in zip(*np.nonzero((corners == candidate[:8, :8]).all(axis=(2, 3, 4)))):
            if (image[top:top + size, left:left + size] == candidate).all():
                return int(top), int(left), mirrored
    pytest.fail("the training crop is no 224 window of the resized image")
