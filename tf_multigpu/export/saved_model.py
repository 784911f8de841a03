"""SavedModel export of a trained network, as a plain single-device model ready to serve.

We export from weights, not from the live distributed state: the caller builds a fresh
single-device model, loads the trained values into it, and passes it here. The
`serving_default` signature takes images as the data set stores them (any batch size) and
returns class probabilities and class ids; the preprocessing is inside the graph, so a client
needs nothing of ours. Writing goes to a temporary directory that replaces the old export
only once complete, so a failed export never destroys the previous one.
"""

from __future__ import annotations

import json
import os
import shutil

import keras
import tensorflow as tf

from tf_multigpu.data.source import ImageSource
from tf_multigpu.errors import UsageError

SIGNATURE = "serving_default"
METADATA_FILE = os.path.join("assets.extra", "metadata.json")   # TF Serving's place for extras


def export_saved_model(model: keras.Model, source: ImageSource, export_dir: str, metadata: dict) -> str:
    """Writes `model` with preprocessing as a SavedModel at `export_dir`; returns the path."""
    archive = keras.export.ExportArchive()
    archive.track(model)

    def serve(images):
        logits = model(source.preprocess(images), training=False)
        return {
            "probabilities": tf.nn.softmax(logits, axis=-1),
            "class_ids": tf.argmax(logits, axis=-1, output_type=tf.int32),
        }

    spec = tf.TensorSpec([None, *source.image_shape], source.pixel_dtype, name="images")
    archive.add_endpoint(SIGNATURE, serve, input_signature=[spec])

    export_dir = os.path.abspath(export_dir)
    parent = os.path.dirname(export_dir)
    staging = f"{export_dir}.tmp-{os.getpid()}"
    try:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        archive.write_out(staging, verbose=False)
        os.makedirs(os.path.join(staging, "assets.extra"), exist_ok=True)
        with open(os.path.join(staging, METADATA_FILE), "w") as f:
            json.dump(metadata, f, indent=2, sort_keys=True, default=str)
        _replace_dir(staging, export_dir)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise UsageError(f"cannot write the export to {export_dir} ({e.strerror or e}): "
                         "choose a writable --export_dir or free space; the previous export is untouched") from None
    return export_dir


def _replace_dir(new: str, target: str) -> None:
    """Moves `new` to `target`; the old `target` is removed only after the move succeeded."""
    old = f"{target}.old-{os.getpid()}"
    if os.path.exists(target):
        os.replace(target, old)
    try:
        os.replace(new, target)
    except OSError:
        if os.path.exists(old):
            os.replace(old, target)   # put the previous export back
        raise
    shutil.rmtree(old, ignore_errors=True)
