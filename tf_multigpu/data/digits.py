"""scikit-learn's handwritten digits: 1,797 real 8x8 grey images, shipped inside the package.

The default data set: it needs no download, so the quick start and CI train on real data.
Pixels are stored as 0..16 (uint8). The test split is fixed (20%, stratified, independent of
--seed) so every run evaluates on the same 360 images.
"""

import numpy as np
import tensorflow as tf

from tf_multigpu.data.source import ImageSource

TEST_FRACTION = 0.2
SPLIT_SEED = 0


def load_digits_source() -> ImageSource:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.uint8)[..., None]          # (1797, 8, 8, 1), 0..16
    labels = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=labels)
    return ImageSource(
        name="digits",
        image_shape=(8, 8, 1),
        num_classes=10,
        class_names=tuple(str(d) for d in range(10)),
        num_train=len(x_train),
        num_test=len(x_test),
        pixel_dtype=tf.uint8,
        pixel_max=16.0,
        train_records=lambda: tf.data.Dataset.from_tensor_slices((x_train, y_train)),
        test_records=lambda: tf.data.Dataset.from_tensor_slices((x_test, y_test)),
        batch_decode=lambda records: records,   # records are the pixels: decode is the identity
    )
