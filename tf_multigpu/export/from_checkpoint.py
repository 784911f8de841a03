"""Exporting a run's checkpoint after the fact, whatever strategy trained it.

`export_from_checkpoint(run_dir)` reads the run's config.json, rebuilds its data source and
the plain single-device model, restores the model part of a training checkpoint into it,
measures it on the test split, and writes the same export as the end of a training run.

A training checkpoint holds the model, the optimizer (slots, step) and the dropout RNG
state; only the model is needed here, so the restore is partial (`expect_partial`). Every
weight of the model must come from the checkpoint, though: a weight left at its random
initial value would serve garbage without a warning, so it is an error.
"""

from __future__ import annotations

import os
import re

import keras
import tensorflow as tf

from tf_multigpu.config import RunPaths, check_exportable_run, no_checkpoint
from tf_multigpu.config.config import checkpoints_on_disk
from tf_multigpu.data import load_source
from tf_multigpu.data.pipeline import drop_undecodable
from tf_multigpu.data.source import ImageSource
from tf_multigpu.errors import UsageError
from tf_multigpu.export.saved_model import export_saved_model
from tf_multigpu.models import build_model

_STEP_KEY = "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"
_EVAL_BATCH = 256


def export_from_checkpoint(run_dir: str, checkpoint: str | None = None, export_dir: str | None = None,
                           evaluate: bool = True) -> dict:
    """Exports a checkpoint of the run in `run_dir` (default: its latest) to `export_dir`
    (default: RUN_DIR/export); returns the metadata written, with `export_dir` added."""
    cfg = check_exportable_run(run_dir, checkpoint, export_dir)   # the export dir too: before the long part
    checkpoint = find_checkpoint(run_dir, checkpoint)
    export_dir = os.path.abspath(export_dir or RunPaths(run_dir).export)

    # The run's own data options: the same test split, crops and left-out files as in training.
    source = load_source(cfg.dataset, cfg.data_dir, cfg.image_size, augment=cfg.augment,
                         test_fraction=cfg.test_fraction, skip_bad_images=cfg.skip_bad_images)
    model = build_model(cfg.model, source.image_shape, source.num_classes)
    restore_weights(model, checkpoint)
    metadata = {
        "config": cfg.to_dict(),
        "metrics": evaluate_model(model, source) if evaluate else {},
        "step": checkpoint_step(checkpoint),
    }
    path = export_saved_model(model, source, export_dir, metadata, checkpoint=checkpoint)
    return {**metadata, "checkpoint": checkpoint, "export_dir": path}


def find_checkpoint(run_dir: str, checkpoint: str | None = None) -> str:
    """The checkpoint prefix to export: `checkpoint` (a prefix, or a directory meaning its
    latest), else the latest checkpoint of the run."""
    if checkpoint is None:
        directory = RunPaths(run_dir).checkpoints
        try:
            found = tf.train.latest_checkpoint(directory)
        except ValueError:   # an empty state file (TensorFlow: "Invalid checkpoint state")
            found = None
        if not found or not tf.io.gfile.exists(found + ".index"):
            # The state file lost, garbled or naming moved files: the newest on disk, as a resumed run takes.
            on_disk = checkpoints_on_disk(directory)
            if not on_disk:
                raise no_checkpoint(run_dir)
            found = on_disk[-1]
        return found
    if os.path.isdir(checkpoint):
        found = tf.train.latest_checkpoint(checkpoint)
        if not found:
            raise UsageError(f"--checkpoint={checkpoint} is a directory without checkpoints: "
                             "give a checkpoint prefix such as RUN_DIR/checkpoints/ckpt-100")
        return found
    if not tf.io.gfile.exists(checkpoint + ".index"):
        raise UsageError(f"--checkpoint={checkpoint} is not a checkpoint (no {checkpoint}.index): "
                         "give a prefix such as RUN_DIR/checkpoints/ckpt-100, without .index")
    return checkpoint


def restore_weights(model: keras.Model, checkpoint: str) -> None:
    """Loads every weight of `model` from a training checkpoint; UsageError if any is missing."""
    try:
        status = tf.train.Checkpoint(model=model).restore(checkpoint).expect_partial()
    except Exception as e:  # noqa: BLE001  shape mismatch: ValueError; truncated file: IndexError, OpError...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, ValueError):
            raise UsageError(f"checkpoint {checkpoint} does not fit the run's model ({first[:200]}): "
                             "pass a --checkpoint of this run") from None
        raise UsageError(f"checkpoint {checkpoint} cannot be read ({first[:200]}): it is damaged; pass an earlier "
                         "one of this run with --checkpoint (RUN_DIR/checkpoints keeps the last few)") from None
    try:
        # Fails for every weight of the model that found no value in the checkpoint. (The
        # dropout RNG state is not a checkpoint dependency of the model, so it is not asked for.)
        status.assert_existing_objects_matched()
    except AssertionError as e:
        missing = re.findall(r"path=([^\s,]+)", str(e))
        listed = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise UsageError(f"checkpoint {checkpoint} holds no value for {len(missing) or 'some'} weight(s) of "
                         f"the model ({listed or model.name}): it is not a checkpoint of this run's model; "
                         "pass a --checkpoint of this run") from None


def checkpoint_step(checkpoint: str) -> int | None:
    """The training step a checkpoint was taken at (the optimizer's iteration count)."""
    reader = tf.train.load_checkpoint(checkpoint)
    if reader.has_tensor(_STEP_KEY):
        return int(reader.get_tensor(_STEP_KEY))
    suffix = re.search(r"-(\d+)$", checkpoint)   # CheckpointManager names them ckpt-STEP
    return int(suffix.group(1)) if suffix else None


def evaluate_model(model: keras.Model, source: ImageSource) -> dict:
    """Test loss and accuracy of `model` on the test split, fed stored pixels through
    `source.preprocess` exactly as the serving signature does."""
    @tf.function
    def sums(images, labels):
        logits = model(source.preprocess(images), training=False)
        loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        hits = tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), tf.cast(labels, tf.int32))
        return tf.reduce_sum(loss), tf.reduce_sum(tf.cast(hits, tf.float32))

    loss_sum = correct = count = 0.0
    # images damaged in their middle dropped, as training dropped them (--skip_bad_images)
    batches = drop_undecodable(source, source.test_records().map(lambda r, y: (source.decode(r), y)))
    batches = batches.batch(_EVAL_BATCH)
    for images, labels in batches:
        loss, hits = sums(images, labels)
        loss_sum, correct, count = loss_sum + float(loss), correct + float(hits), count + len(labels)
    if not count:
        return {}
    return {"test_loss": loss_sum / count, "test_accuracy": correct / count}
