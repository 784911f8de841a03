"""Data sets by name and the input pipeline that feeds every strategy.

`load_source(name, data_dir, image_size)` resolves `digits`, `synthetic` or `tfds:NAME`;
`pipeline` turns a source into seeded, resumable, per-replica batches.
"""

from tf_multigpu.data.source import ImageSource
from tf_multigpu.errors import UsageError

NAMES = ("digits", "synthetic", "tfds:NAME")


def load_source(name: str, data_dir=None, image_size: int = 0) -> ImageSource:
    """The ImageSource for a --dataset value; UsageError names the choices if unknown."""
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
        return load_tfds_source(name[5:], data_dir, image_size)
    raise UsageError(f"unknown --dataset={name!r}: choose one of {', '.join(NAMES)}")


__all__ = ["ImageSource", "load_source", "NAMES"]
