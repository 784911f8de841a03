"""Data sets by name and the input pipeline that feeds every strategy.

`load_source(name, data_dir, image_size, ...)` resolves `digits`, `synthetic`, `tfds:NAME` or
`folder:PATH`;
`pipeline` turns a source into seeded, resumable, per-replica batches.

Importing this package does not import TensorFlow (`check_dataset_flags` runs before the
entry point starts it); `ImageSource` and the loaders load on first use.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from tf_multigpu.errors import UsageError

if TYPE_CHECKING:
    from tf_multigpu.data.source import ImageSource

NAMES = ("digits", "synthetic", "tfds:NAME", "folder:PATH")


def load_source(name: str, data_dir=None, image_size: int = 0, *, augment: str = "auto",
                test_fraction=None, skip_bad_images: bool = False, input_threads: int = 0) -> ImageSource:
    """The ImageSource for a --dataset value; UsageError names the choices if unknown.

    `augment` (data/augment.py) applies to images (tfds: and folder:), `test_fraction` and
    `skip_bad_images` to folders; elsewhere they are refused rather than ignored.
    `input_threads` sizes the pipelines' thread pool (0: tf.data's default, one per core)."""
    source = _load(name, data_dir, image_size, augment, test_fraction, skip_bad_images)
    return dataclasses.replace(source, input_threads=input_threads) if input_threads else source


def check_dataset_flags(name: str, image_size: int = 0, augment: str = "auto", test_fraction=None,
                        skip_bad_images: bool = False) -> None:
    """The --dataset rules the flags alone decide (a known name, options that apply to it, a
    folder that exists), without TensorFlow: the loaders and the entry point (train.py, before
    it starts TensorFlow) share them."""
    folder = name.startswith("folder:") and len(name) > 7
    if not folder and (test_fraction is not None or skip_bad_images):
        raise UsageError(f"--test_fraction and --skip_bad_images apply to --dataset=folder:PATH, not {name}: drop them")
    if augment == "paper" and not (folder or name.startswith("tfds:")):
        raise UsageError(f"--augment=paper applies to photos (--dataset=folder:PATH or tfds:NAME), not {name}")
    if name == "digits" and image_size:
        raise UsageError("--image_size does not apply to --dataset=digits (8x8 images): drop it")
    if folder and os.path.isfile(name[7:]):   # "no such directory" misled: it exists (an archive, often)
        raise UsageError(f"--dataset={name}: {name[7:]} is a file, not a folder: give a folder holding one "
                         "subfolder of images per class (unpack an archive first)")
    if folder and not os.path.isdir(name[7:]):
        raise UsageError(f"--dataset={name}: no such directory: give a folder holding one subfolder of images "
                         "per class")
    if not (folder or name in ("digits", "synthetic") or name.startswith("tfds:") and len(name) > 5):
        raise UsageError(f"unknown --dataset={name!r}: choose one of {', '.join(NAMES)}")


def _load(name, data_dir, image_size, augment, test_fraction, skip_bad_images):
    check_dataset_flags(name, image_size, augment, test_fraction, skip_bad_images)
    folder = name.startswith("folder:")
    if name == "digits":
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
    raise AssertionError(f"check_dataset_flags let --dataset={name!r} through")


def __getattr__(name: str):
    if name == "ImageSource":   # imports TensorFlow
        from tf_multigpu.data.source import ImageSource
        return ImageSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ImageSource", "check_dataset_flags", "load_source", "NAMES"]
