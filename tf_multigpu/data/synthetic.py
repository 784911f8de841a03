"""Random images generated inside the pipeline, for benchmarks (as tf_cnn_benchmarks does).

Each record is an index; `decode` draws the image from a stateless RNG keyed by the index, so
the data are the same on every run and device count and cost no disk. A pool of POOL_SIZE
images is the "train split" (epochs exist, shuffling and resume work as for real data).
"""

import tensorflow as tf

from tf_multigpu.data.source import ImageSource

POOL_SIZE = 4096
TEST_SIZE = 512
NUM_CLASSES = 1000
DEFAULT_SIZE = 224


def load_synthetic_source(image_size: int = 0) -> ImageSource:
    size = image_size or DEFAULT_SIZE
    shape = (size, size, 3)

    def records(offset, count):
        idx = tf.data.Dataset.range(offset, offset + count)
        return idx.map(lambda i: (i, tf.cast(i % NUM_CLASSES, tf.int32)))

    def decode(index):
        seed = tf.stack([tf.constant(1234, tf.int64), index])
        pixels = tf.random.stateless_uniform(shape, seed=seed, minval=0, maxval=256, dtype=tf.int32)
        return tf.cast(pixels, tf.uint8)

    return ImageSource(
        name="synthetic",
        image_shape=shape,
        num_classes=NUM_CLASSES,
        class_names=tuple(f"class_{i}" for i in range(NUM_CLASSES)),
        num_train=POOL_SIZE,
        num_test=TEST_SIZE,
        pixel_dtype=tf.uint8,
        pixel_max=255.0,
        train_records=lambda: records(0, POOL_SIZE),
        test_records=lambda: records(POOL_SIZE, TEST_SIZE),
        decode=decode,
    )
