"""What a run does with its directory: refuse an unusable one (`check_previous_run`, in config:
the entry point applies it before TensorFlow starts), resume from what an earlier run
left, write files atomically. Where each file lives is `config.RunPaths`'s alone (export
reads the same layout without importing training).

Nothing here deletes or overwrites an earlier run's results before the new run is known to
be valid: a config that computes something else, or an unreadable checkpoint, is refused.
"""

from __future__ import annotations

import json
import os

import tensorflow as tf

from tf_multigpu.config import RunPaths
from tf_multigpu.errors import UsageError

KEEP_CHECKPOINTS = 3


def restore_latest(checkpoint: tf.train.Checkpoint, paths: RunPaths) -> tf.train.CheckpointManager:
    """A CheckpointManager for the run; restores its latest checkpoint if there is one."""
    manager = tf.train.CheckpointManager(checkpoint, paths.checkpoints, max_to_keep=KEEP_CHECKPOINTS)
    latest = manager.latest_checkpoint
    if latest:
        try:
            # expect_partial: a checkpoint may hold values no object asks for (the stock
            # Dropout seed states of runs from before StatelessDropout); every object of this
            # run must still find its value.
            checkpoint.restore(latest).expect_partial().assert_existing_objects_matched()
        except Exception as e:  # noqa: BLE001  truncated files raise IndexError, others OpError...
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"checkpoint {latest} cannot be restored ({first_line[:200]}): "
                             "move it away to resume from an earlier one, or use a new --run_dir") from None
    return manager


def write_json(path: str, values: dict) -> None:
    """Writes `values` atomically (a crash leaves the previous file, never half of one)."""
    staging = f"{path}.tmp-{os.getpid()}"
    with open(staging, "w") as f:
        json.dump(values, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(staging, path)
