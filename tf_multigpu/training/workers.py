"""Who writes what in a multi-worker run: the chief writes the run directory, the others only
take part.

Every worker runs the same loop and must make the same collective calls, including saving
checkpoints (MultiWorkerMirroredStrategy requires every worker to save; DTensor's save is one
SPMD operation in which each client writes its own shards). So:
- checkpoints: the chief saves into --run_dir/checkpoints. Under MultiWorkerMirroredStrategy
  the other workers save the same values into a private temporary directory, deleted at the
  end, as TensorFlow's multi-worker guide prescribes. Under DTensor every client saves to
  the same --run_dir/checkpoints prefix (a shared filesystem), each writing its shards, and
  so each also rewrites the state file after a fallback restore (`name_checkpoints`: the
  same text from every client).
- config.json, TensorBoard summaries, summary.json and the export: the chief only.
Every worker restores from --run_dir/checkpoints, which must be on a shared filesystem.
"""

from __future__ import annotations

import shutil
import tempfile

import tensorflow as tf

from tf_multigpu.config import Config, RunPaths
from tf_multigpu.training import run_dir


class WorkerRole:
    """The writes of this worker: all of them in one process or on the chief, none elsewhere."""

    def __init__(self, runtime=None, shared_checkpoints: bool = False):
        self.is_chief = runtime is None or runtime.is_chief
        self.task_index = 0 if runtime is None else runtime.cluster.task_index
        self._shared_checkpoints = shared_checkpoints
        self._temp_dirs = []
        self._unnamed = None   # (checkpoint, paths, prefixes) for name_checkpoints

    def checkpoint_manager(self, checkpoint: tf.train.Checkpoint, paths: RunPaths) -> tf.train.CheckpointManager:
        """Restores the run's latest checkpoint; returns the manager this worker saves with
        (replaced by `name_checkpoints` once the run starts writing, after a fallback restore)."""
        manager, unnamed = run_dir.restore_latest(checkpoint, paths)
        if self.is_chief or self._shared_checkpoints:
            self._unnamed = (checkpoint, paths, unnamed) if unnamed else None
            return manager
        temp = tempfile.mkdtemp(prefix=f"tf_multigpu_worker{self.task_index}_")
        self._temp_dirs.append(temp)
        return tf.train.CheckpointManager(checkpoint, temp, max_to_keep=1)

    def name_checkpoints(self, manager: tf.train.CheckpointManager) -> tf.train.CheckpointManager:
        """The manager to save with from now on: after a restore from a checkpoint the state
        file did not name (run_dir.restore_latest), one that knows the checkpoints on disk,
        the state file rewritten to name them. Called once the run starts writing."""
        if not self._unnamed:
            return manager
        manager, self._unnamed = run_dir.name_checkpoints(*self._unnamed), None
        return manager

    def write_config(self, cfg: Config, paths: RunPaths) -> None:
        if self.is_chief:
            tf.io.gfile.makedirs(paths.root)
            cfg.write(paths.config)

    def summary_writer(self, paths: RunPaths):
        if self.is_chief:
            return tf.summary.create_file_writer(paths.tensorboard)
        return tf.summary.create_noop_writer()

    def write_summary(self, paths: RunPaths, summary: dict) -> None:
        if self.is_chief:
            run_dir.write_json(paths.summary, summary)

    def close(self) -> None:
        """Deletes this worker's temporary checkpoints."""
        for temp in self._temp_dirs:
            shutil.rmtree(temp, ignore_errors=True)
        self._temp_dirs = []
