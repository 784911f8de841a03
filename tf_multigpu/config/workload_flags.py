"""The flags that say which workload a command runs: --model, --dataset, --data_dir,
--image_size and --batch_size, defined once for tf-multigpu-train, tf-multigpu-plan and the
tools under tools/, so they have the same names, meanings and help everywhere.

A command picks the ones it takes and its own defaults (a benchmark defaults to synthetic
data, training to the digits); `check_workload_flags` validates what every command validates
alike, with the fix in the message.
"""

from __future__ import annotations

from absl import flags

from tf_multigpu.config.config import check_data_dir, check_model_name
from tf_multigpu.errors import UsageError

WORKLOAD_FLAGS = ("model", "dataset", "data_dir", "image_size", "batch_size")

_HELP = {
    "model": "alexnet, small_convnet, or package.module:function returning a Keras model from "
             "(input_shape, num_classes).",
    "dataset": "digits (scikit-learn's 1,797 handwritten digits, no download), synthetic (random "
               "ImageNet-shaped images, for benchmarks), tfds:NAME (a TFDS image classification set "
               "prepared under --data_dir), or folder:PATH (your images: PATH/CLASS/*.jpg, or "
               "PATH/train/CLASS/ and PATH/val/CLASS/; JPEG, PNG, BMP, GIF).",
    "data_dir": "TFDS data directory for --dataset=tfds:NAME.",
    "image_size": "Resize images to SIZE x SIZE (0: the data set's own size; synthetic and folders: 224); "
                  "with --augment=paper, the crop size.",
    "batch_size": "GLOBAL batch size, split evenly over the replicas.",
}
_DEFAULTS = {"model": "small_convnet", "dataset": "digits", "data_dir": None, "image_size": 0, "batch_size": 64}


def define_workload_flags(names=WORKLOAD_FLAGS, flag_values=flags.FLAGS, **defaults) -> tuple:
    """Defines the workload flags `names` (with `defaults` overriding ours); returns `names`."""
    unknown = set(names) - set(WORKLOAD_FLAGS) or set(defaults) - set(names)
    if unknown:
        raise ValueError(f"not workload flags (or not defined here): {sorted(unknown)}")
    for name in names:
        if name in flag_values:
            # Defined already by another command's module in this process (tests import several
            # tools): one flag, one meaning; a process that runs a command defines it once.
            continue
        default = defaults.get(name, _DEFAULTS[name])
        if name in ("image_size", "batch_size"):
            flags.DEFINE_integer(name, default, _HELP[name], flag_values=flag_values)
        else:
            flags.DEFINE_string(name, default, _HELP[name], flag_values=flag_values)
    return tuple(names)


def check_workload_flags(flag_values=flags.FLAGS) -> None:
    """The checks every command makes of the workload flags it defines (UsageError, one line)."""
    if "batch_size" in flag_values and flag_values.batch_size < 1:
        raise UsageError(f"--batch_size={flag_values.batch_size} must be >= 1 (the GLOBAL batch)")
    if "image_size" in flag_values and flag_values.image_size < 0:
        raise UsageError(f"--image_size={flag_values.image_size} must be >= 0 (0: the data set's own size)")
    if "model" in flag_values:
        check_model_name(flag_values.model)
    if "data_dir" in flag_values and "dataset" in flag_values:
        check_data_dir(flag_values.dataset, flag_values.data_dir)
