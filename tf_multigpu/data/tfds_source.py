"""Any TFDS image classification data set (`--dataset=tfds:cifar10`, `tfds:imagenet2012`...).

Nothing is downloaded at run time: the set must already be prepared under --data_dir (or
TFDS' default directory). Records are the undecoded image bytes (SkipDecoding), so shuffling
and the skip on resume cost no JPEG decoding; images are decoded with the feature's own
decoder and resized to --image_size (required when the set's images vary in size, default 224).
With `--augment=paper` (the default for imagenet2012) they go through the paper's recipe
instead (data/augment.py): shorter side 256, random 224 crops and mirroring for training.
"""

import re

import tensorflow as tf

from tf_multigpu.data import augment as augments
from tf_multigpu.data.source import ImageSource
from tf_multigpu.errors import UsageError, error_reason

DEFAULT_SIZE_FOR_VARIABLE_IMAGES = 224


def load_tfds_source(name: str, data_dir=None, image_size: int = 0, augment: str = "auto") -> ImageSource:
    """The ImageSource of a prepared TFDS set; `augment` as data/augment.py (auto: paper for
    imagenet2012, none otherwise)."""
    import tensorflow_datasets as tfds

    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError as e:   # its message: every name, then a near one
        near = re.search(r"Did you mean: \S+ -> (\S+)", str(e))
        hint = f"did you mean tfds:{near.group(1)}? " if near else ""
        raise UsageError(f"--dataset=tfds:{name}: TFDS has no such data set; {hint}see `tfds.list_builders()` "
                         "for the names") from None
    except Exception as e:  # noqa: BLE001  a version it does not have (AssertionError), an unreadable dataset_info...
        raise UsageError(f"--dataset=tfds:{name}: TFDS cannot load it ({error_reason(e)}): check the name and "
                         "version (tfds:NAME or tfds:NAME:VERSION) and --data_dir, or prepare it with "
                         "`tfds build`") from None
    features = builder.info.features
    if "image" not in features or "label" not in features:
        raise UsageError(f"--dataset=tfds:{name} is not an image classification set "
                         "(it needs 'image' and 'label' features)")
    image_feature, label_feature = features["image"], features["label"]
    known_splits = set(builder.info.splits.keys())
    test_split = "validation" if "validation" in known_splits or not known_splits else "test"
    if known_splits and test_split not in known_splits:
        raise UsageError(f"--dataset=tfds:{name} has no test or validation split")

    def records(split):
        return builder.as_dataset(split=split, shuffle_files=False, as_supervised=True,
                                  decoders={"image": tfds.decode.SkipDecoding()})

    try:
        train, test = records("train"), records(test_split)
    except (AssertionError, FileNotFoundError, tf.errors.NotFoundError):
        where = data_dir or "TFDS' default data directory"
        raise UsageError(f"--dataset=tfds:{name} is not prepared in {where}: run `tfds build {name} "
                         f"--data_dir=DIR` where the data can be downloaded, then pass --data_dir=DIR") from None

    height, width, channels = image_feature.shape
    if image_size:
        height = width = image_size
    elif height is None or width is None:
        height = width = DEFAULT_SIZE_FOR_VARIABLE_IMAGES
    shape = (height, width, channels)
    resize = tuple(image_feature.shape[:2]) != (height, width)

    def decode(record):
        image = image_feature.decode_example(record)
        if resize:
            image = tf.image.resize(image, (height, width), antialias=True)
            image = tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)
        return tf.ensure_shape(image, shape)

    def count(split, ds):
        if split in known_splits:
            return builder.info.splits[split].num_examples
        return int(ds.cardinality().numpy())   # mock data and sets without split metadata

    names = tuple(label_feature.names) if hasattr(label_feature, "names") else tuple(
        str(i) for i in range(label_feature.num_classes))
    source = ImageSource(
        name=f"tfds:{name}",
        image_shape=shape,
        num_classes=label_feature.num_classes,
        class_names=names,
        num_train=count("train", train),
        num_test=count(test_split, test),
        pixel_dtype=tf.uint8,
        pixel_max=255.0,
        train_records=lambda: records("train"),
        test_records=lambda: records(test_split),
        decode=decode,
    )
    if augment == "auto":
        augment = "paper" if name.split("/")[0].split(":")[0] == "imagenet2012" else "none"
    if augment == "none":
        return source
    if channels != 3:
        raise UsageError(f"--augment={augment} needs colour images, but tfds:{name} has {channels} channel(s): "
                         "use --augment=none")
    return augments.with_augment(source, image_feature.decode_example, augment, image_size or height)
