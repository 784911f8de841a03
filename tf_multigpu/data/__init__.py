"""Data sets by name and the input pipeline that feeds every strategy.

`load_source(name, data_dir, image_size, ...)` resolves `digits`, `synthetic`, `tfds:NAME` or
`folder:PATH`;
`pipeline` turns a source into seeded, resumable, per-replica batches.
"""

import dataclasses

from tf_multigpu.data.source import ImageSource
from tf_multigpu.errors import UsageError

NAMES = ("digits", "synthetic", "tfds:NAME", "folder:PATH")


def load_source(name: str, data_dir=None, image_size: int = 0, *, augment: str = "auto",
                test_fraction=None, skip_bad_images: bool = False, input_threads: int = 0) -> ImageSource:
    """The ImageSource for a --dataset value; UsageError names the choices if unknown.

    `augment` (data/augment.py) applies to images (tfds: and folder:), `test_fraction` and
    `skip_bad_images` to folders; elsewhere they are refused rather than ignored.
    `input_threads` sizes the pipelines' thread pool (0: tf.data's default, one per core)."""
    source = _load(name, data_dir, image_size, augment, test_fraction, skip_bad_images)
    return dataclasses.replace(source, input_threads=input_threads) if input_threads else source


def _load(name, data_dir, image_size, augment, test_fraction, skip_bad_images):
    folder = name.startswith("folder:") and len(name) > 7
    if not folder and (test_fraction is not None or skip_bad_images):
        raise UsageError(f"--test_fraction and --skip_bad_images apply to --dataset=folder:PATH, not {name}: drop them")
    if augment == "paper" and not (folder or name.startswith("tfds:")):
        raise UsageError(f"--augment=paper applies to photos (--dataset=folder:PATH or tfds:NAME), not {name}")
    if name == "digits":
        if image_size:
            raise UsageError("--image_size does not apply to --dataset=digits (8x8 images): drop it")
        from tf_multigpu.data.digits import load_digits_source
        return load_digits_source()
    if name == "synthetic":
        from tf_multigpu.data.synthetic import load_synthetic_source
        return load_synthetic_source(image_size)
    if name.startswith("tfds:") and len(name) > 5:
        from tf_multigpu.data.tfds_source import load_tfds_source
        return load_tfds_source(name[5:], data_dir, image_size, augment)
    if folder:
        from tf_multigpu.data.folder import load_folder_source
        return load_folder_source(name[7:], image_size, augment, test_fraction, skip_bad_images)
    raise UsageError(f"unknown --dataset={name!r}: choose one of {', '.join(NAMES)}")


__all__ = ["ImageSource", "load_source", "NAMES"]
