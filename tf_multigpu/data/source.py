"""What every data set provides: records in a fixed order, a decoder and a preprocessor.

A source's records are cheap (undecoded) elements in a fixed order; the pipeline shuffles,
skips and batches them before `decode` runs, so resuming at step K skips K batches without
decoding them. `preprocess` turns a batch of stored pixels into the model's float input; the
export embeds the same function, so a client sends pixels as the data set stores them.
A source may augment its training images (`train_decode`): decoded per example with a key
derived from (seed, the example's global position), so augmentation is seeded and stateless.
A source whose records need no per-example decoding (pixels in memory) may say so with
`batch_decode`: the training pipeline then decodes a whole batch in one call instead of one
record at a time, for the same batches (data/pipeline.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class ImageSource:
    """An image classification data set with a train and a test split."""

    name: str
    image_shape: tuple            # (height, width, channels) after decode
    num_classes: int
    class_names: tuple
    num_train: int
    num_test: int
    pixel_dtype: tf.DType         # how the data set stores a pixel (uint8 for all ours)
    pixel_max: float              # the largest stored pixel value (16 for digits, 255 for photos)
    train_records: Callable[[], tf.data.Dataset]   # (record, label) in a fixed order
    test_records: Callable[[], tf.data.Dataset]
    decode: Callable = lambda record: record        # record -> image of image_shape, pixel_dtype
    # (record, key) -> image for training, key = (seed, the example's position in the batch
    # stream): a seeded random augmentation (data/augment.py). None: `decode`.
    train_decode: Callable | None = None
    # (records of a batch) -> their images: exactly `decode` of each record, stacked, in one
    # call. Set only where that is cheaper than tf.data's parallel per-record map (digits:
    # identity); ignored if the source augments (`train_decode`). None: decoded per element.
    batch_decode: Callable | None = None
    skipped: tuple = ()           # files left out as unreadable (--skip_bad_images)
    # --skip_bad_images (a folder): the pipelines drop a record whose decoding fails (tf.data's
    # ignore_errors) instead of stopping the run. The folder's up-front check reads the ends of
    # a file (data/folder.py `_problem`), so an image damaged in its middle gets through it.
    skip_bad_images: bool = False
    input_threads: int = 0        # tf.data threads for this source's pipelines (0: one per core)

    def decode_train(self, record, key: tf.Tensor) -> tf.Tensor:
        """A training example's image: `train_decode` if the source augments, else `decode`."""
        return self.train_decode(record, key) if self.train_decode else self.decode(record)

    def preprocess(self, images: tf.Tensor) -> tf.Tensor:
        """Stored pixels -> float32 in [-1, 1], the model's input."""
        scale = 2.0 / self.pixel_max
        return tf.cast(images, tf.float32) * scale - 1.0
