"""How a decoded image becomes the model's input: fitted to a size, or the paper's recipe.

`none` resizes every image to SIZE x SIZE (train and test alike). `paper` is Krizhevsky et
al. 2012's ImageNet recipe: the shorter side resized to 256, then a random 224 crop and a
random horizontal flip for training, the centre 224 crop for testing (for another
--image_size the 256 scales with it: 256/224 of the crop). The random draws are stateless,
keyed by (seed, the example's global position in the batch stream), so an example is
cropped the same way under every strategy, worker count and after a resume.

Only the geometry lives here; a source gives `raw_decode(record) -> uint8 (h, w, 3)` of any
size and `with_augment` turns it into the source's `decode` (test) and `train_decode`.
"""

import dataclasses

import tensorflow as tf

from tf_multigpu.data.source import ImageSource
from tf_multigpu.errors import UsageError

AUGMENTS = ("auto", "none", "paper")   # auto: paper for ImageNet, none otherwise
PAPER_SHORTER, PAPER_CROP = 256, 224


def shorter_side(crop: int) -> int:
    """The shorter side the paper's recipe resizes to before cropping `crop` (256 for 224)."""
    return round(crop * PAPER_SHORTER / PAPER_CROP)


def resize_shorter(image: tf.Tensor, size: int) -> tf.Tensor:
    """`image` (h, w, c) scaled, aspect kept, so that its shorter side is `size`; uint8."""
    hw = tf.cast(tf.shape(image)[:2], tf.float32)
    new = tf.maximum(tf.cast(tf.round(hw * (size / tf.reduce_min(hw))), tf.int32), size)
    return _to_uint8(tf.image.resize(image, new, antialias=True))


def fit(image: tf.Tensor, size: int) -> tf.Tensor:
    """`image` resized to (size, size), aspect not kept (what `--augment=none` does); uint8."""
    return _to_uint8(tf.image.resize(image, (size, size), antialias=True))


def paper_train(image: tf.Tensor, key: tf.Tensor, crop: int) -> tf.Tensor:
    """Shorter side to 256/224*crop, a random crop x crop window, a random mirror; uint8."""
    crop_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
    resized = resize_shorter(image, shorter_side(crop))
    window = tf.image.stateless_random_crop(resized, (crop, crop, 3), seed=crop_key)
    return tf.image.stateless_random_flip_left_right(window, seed=flip_key)


def paper_test(image: tf.Tensor, crop: int) -> tf.Tensor:
    """Shorter side to 256/224*crop, then the centre crop x crop window; uint8."""
    return tf.image.resize_with_crop_or_pad(resize_shorter(image, shorter_side(crop)), crop, crop)


def with_augment(source: ImageSource, raw_decode, augment: str, size: int) -> ImageSource:
    """`source` with decode (test) and train_decode (train) made from `raw_decode`."""
    shape = (size, size, 3)
    if augment == "paper":
        def decode(record):
            return tf.ensure_shape(paper_test(raw_decode(record), size), shape)

        def train_decode(record, key):
            return tf.ensure_shape(paper_train(raw_decode(record), key, size), shape)
    elif augment == "none":
        def decode(record):
            return tf.ensure_shape(fit(raw_decode(record), size), shape)
        train_decode = None
    else:
        raise UsageError(f"unknown --augment={augment!r}: choose one of {', '.join(AUGMENTS)}")
    # batch_decode=None: a batch decoder of the raw records would not resize or crop.
    return dataclasses.replace(source, image_shape=shape, decode=decode, train_decode=train_decode,
                               batch_decode=None)


def _to_uint8(image):
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)
