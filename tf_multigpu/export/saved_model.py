"""SavedModel export of a trained network, as a plain single-device model ready to serve.

We export from weights, not from the live distributed state: the caller builds a fresh
single-device model, loads the trained values into it, and passes it here. Two signatures:

- `serving_default`: images as the data set stores them (uint8, any batch size);
- `serving_float`: the same pixels as float32, on the same scale (0..16 for digits, 0..255
  for photos), for clients that already hold floats.

Both return `probabilities` and `class_ids`; the preprocessing is inside the graph, so a
client needs nothing of ours. Next to the SavedModel's own files go `assets.extra/
metadata.json` (what was exported, from where, how good it is) and `assets.extra/model.keras`
(the same plain model as a Keras file: logits out, no preprocessing; not written, with a
warning and `"keras_file": null` in the metadata, for a subclassed model without
`get_config`, which Keras cannot serialise). `assets.extra` is TF Serving's place for extra
files; the SavedModel loader ignores it.

Everything is written to a staging directory beside the target, which replaces the old
export only once complete: a failed export never destroys or alters the previous one.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil

import keras
import tensorflow as tf
from absl import logging

from tf_multigpu.config.config import EXPORT_KERAS, EXPORT_METADATA, check_export_dir
from tf_multigpu.data.source import ImageSource
from tf_multigpu.errors import UsageError

SIGNATURE = "serving_default"
FLOAT_SIGNATURE = "serving_float"
INPUT_NAME = "images"
# TF Serving's place for extras; config.EXPORT_EXTRAS lists them, for check_export_dir
METADATA_FILE = os.path.join("assets.extra", EXPORT_METADATA)
KERAS_FILE = os.path.join("assets.extra", EXPORT_KERAS)


def export_saved_model(model: keras.Model, source: ImageSource, export_dir: str, metadata: dict,
                       *, checkpoint: str | None = None) -> str:
    """Writes `model` with preprocessing as a SavedModel at `export_dir`; returns the path.

    `metadata` (config, metrics, step...) goes to assets.extra/metadata.json, completed with
    what the export itself knows (input shape and dtype, class names, signatures, versions,
    and `checkpoint`, the checkpoint the weights came from, when the caller knows it).
    """
    export_dir = os.path.abspath(export_dir)
    check_export_dir(export_dir)
    archive = _serving_archive(model, source)
    staging = f"{export_dir}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(export_dir), exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        archive.write_out(staging, verbose=False)
        os.makedirs(os.path.join(staging, "assets.extra"), exist_ok=True)
        keras_file = _save_keras_file(model, staging)
        with open(os.path.join(staging, METADATA_FILE), "w") as f:
            json.dump(_full_metadata(metadata, source, checkpoint, keras_file), f, indent=2, sort_keys=True,
                      default=str)
        _replace_dir(staging, export_dir)
    except (OSError, tf.errors.OpError) as e:   # write_out reports through tf.io.gfile: OpError
        shutil.rmtree(staging, ignore_errors=True)
        raise UsageError(f"cannot write the export to {export_dir} ({_reason(e)}): "
                         "choose a writable --export_dir or free space; the previous export is untouched") from None
    return export_dir


def _serving_archive(model: keras.Model, source: ImageSource) -> keras.export.ExportArchive:
    """The model with both serving signatures; they differ only in the input dtype."""
    archive = keras.export.ExportArchive()
    archive.track(model)

    def serve(images):
        logits = model(source.preprocess(images), training=False)
        return {
            "probabilities": tf.nn.softmax(logits, axis=-1),
            "class_ids": tf.argmax(logits, axis=-1, output_type=tf.int32),
        }

    shape = [None, *source.image_shape]
    archive.add_endpoint(SIGNATURE, serve, input_signature=[
        tf.TensorSpec(shape, source.pixel_dtype, name=INPUT_NAME)])
    archive.add_endpoint(FLOAT_SIGNATURE, serve, input_signature=[
        tf.TensorSpec(shape, tf.float32, name=INPUT_NAME)])
    return archive


def _save_keras_file(model: keras.Model, staging: str) -> str | None:
    """Writes the model as a Keras file into the staging export; its path there, or None
    where Keras cannot serialise the model (the SavedModel beside it is complete)."""
    path = os.path.join(staging, KERAS_FILE)
    try:
        model.save(path)
    except NotImplementedError:   # Keras: "...must override `get_config()` in order to be serializable"
        if os.path.exists(path):   # the zip Keras had begun
            os.remove(path)
        logging.warning("%s not written: Keras cannot serialise %s (a subclassed model needs get_config()); the "
                        "SavedModel is complete", KERAS_FILE, model.name)
        return None
    return KERAS_FILE


def _full_metadata(metadata: dict, source: ImageSource, checkpoint: str | None, keras_file: str | None) -> dict:
    """The caller's metadata, completed with what describes the export itself."""
    from tf_multigpu import __version__

    shape = [None, *source.image_shape]
    outputs = {"probabilities": {"dtype": "float32", "shape": [None, source.num_classes]},
               "class_ids": {"dtype": "int32", "shape": [None]}}
    defaults = {
        "class_names": list(source.class_names),
        "input_shape": list(source.image_shape),
        "pixel_dtype": source.pixel_dtype.name,
        "pixel_max": source.pixel_max,
        "checkpoint": checkpoint,
    }
    return {
        **defaults, **metadata,
        "signatures": {
            SIGNATURE: {"inputs": {INPUT_NAME: {"dtype": source.pixel_dtype.name, "shape": shape}},
                        "outputs": outputs},
            FLOAT_SIGNATURE: {"inputs": {INPUT_NAME: {"dtype": "float32", "shape": shape}},
                              "outputs": outputs},
        },
        "keras_file": keras_file,
        "exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"tf_multigpu": __version__, "tensorflow": tf.__version__, "keras": keras.__version__},
    }


def _reason(error: Exception) -> str:
    """The cause of a write error, without the path (the message names it once already)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = (getattr(error, "message", None) or str(error) or type(error).__name__).strip()
    return text.splitlines()[0].rsplit("; ", 1)[-1][:200]   # tf.io.gfile writes "PATH; REASON"


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
