"""What a run does with its directory: refuse an unusable one (`check_previous_run`, in config:
the entry point applies it before TensorFlow starts), resume from what an earlier run
left, write files atomically. Where each file lives is `config.RunPaths`'s alone (export
reads the same layout without importing training).

Nothing here deletes or overwrites an earlier run's results before the new run is known to
be valid: a config that computes something else, or an unreadable checkpoint, is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re

import tensorflow as tf
from absl import logging

from tf_multigpu.config import RunPaths
from tf_multigpu.errors import UsageError

KEEP_CHECKPOINTS = 3
LOCK_FILE = ".training.lock"   # held while a run writes the directory (`writing_alone`)


def restore_latest(checkpoint: tf.train.Checkpoint, paths: RunPaths) -> tf.train.CheckpointManager:
    """A CheckpointManager for the run; restores its latest checkpoint if there is one.

    The latest is the one the manager's state file (`checkpoints/checkpoint`) names, if its
    files exist; otherwise the newest checkpoint on disk, with a warning. Trusting the state
    file alone made a run whose state file was lost or garbled start again from step 0 and
    save over the checkpoints it did not see, and a checkpoint moved away (as the error below
    advises) kept being asked for."""
    manager = tf.train.CheckpointManager(checkpoint, paths.checkpoints, max_to_keep=KEEP_CHECKPOINTS)
    named = manager.latest_checkpoint
    on_disk = checkpoints_on_disk(paths.checkpoints)
    # By name: a run directory copied elsewhere may hold a state file with the old paths.
    here = {os.path.basename(prefix): prefix for prefix in on_disk}
    named_here = here.get(os.path.basename(named)) if named else None
    latest = named_here or (on_disk[-1] if on_disk else None)
    if named and not on_disk:
        raise UsageError(f"{paths.checkpoints}/checkpoint names {os.path.basename(named)}, but no checkpoint's "
                         f"files are in {paths.checkpoints}: put them back, or delete that file to train again "
                         "from step 0, or use a new --run_dir")
    if latest != named_here:
        logging.warning("%s/checkpoint %s; resuming from %s, the newest checkpoint there", paths.checkpoints,
                        f"names {os.path.basename(named)}, whose files are gone" if named
                        else "is missing or unreadable", os.path.basename(latest))
    if latest:
        try:
            # expect_partial: a checkpoint may hold values no object asks for (the stock
            # Dropout seed states of runs from before StatelessDropout); every object of this
            # run must still find its value.
            checkpoint.restore(latest).expect_partial().assert_existing_objects_matched()
        except Exception as e:  # noqa: BLE001  truncated files raise IndexError, others OpError...
            earlier = on_disk[:on_disk.index(latest)]
            fix = (f"move its files ({os.path.basename(latest)}.*) out of {paths.checkpoints} to resume from "
                   f"{os.path.basename(earlier[-1])}, the one before, or use a new --run_dir" if earlier else
                   "it is the run's only checkpoint: use a new --run_dir, or move its files out to train again "
                   "from step 0")
            raise UsageError(f"checkpoint {latest} cannot be restored ({error_reason(e)}): {fix}") from None
    return manager


def checkpoints_on_disk(directory: str) -> list[str]:
    """The prefixes of the checkpoints in `directory` whose index file exists, oldest first
    (by the step in their name: ckpt-10 after ckpt-9)."""
    found = []
    for index in tf.io.gfile.glob(os.path.join(directory, "ckpt-*.index")):
        prefix = index[: -len(".index")]
        number = os.path.basename(prefix)[len("ckpt-"):]
        if number.isdigit():
            found.append((int(number), prefix))
    return [prefix for _, prefix in sorted(found)]


@contextlib.contextmanager
def writing_alone(root: str):
    """Holds an exclusive lock on the run directory while this process writes it. A second run
    of the same --run_dir (a command started twice, a forgotten background job) restored the
    same checkpoint and saved its own over this run's, unrefused. flock: the kernel releases
    it when the process dies, so a killed run leaves no stale lock (the file may stay; it
    holds the last owner's process id, for the message)."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, LOCK_FILE)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            owner = handle.read().strip()
            by = f"another process (pid {owner})" if owner else "another process"
            raise UsageError(f"--run_dir={root} is being trained by {by}: wait for it to end or stop it, "
                             "or use another --run_dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.remove(path)   # while still holding it: a run that waits finds no lock file


def write_json(path: str, values: dict) -> None:
    """Writes `values` atomically (a crash leaves the previous file, never half of one)."""
    staging = f"{path}.tmp-{os.getpid()}"
    with open(staging, "w") as f:
        json.dump(values, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(staging, path)


def error_reason(e: Exception, limit: int = 240) -> str:
    """An error's first line that says something, without TensorFlow's wrapping (a graph
    error's "Graph execution error:", "N root error(s) found.", "(0) INVALID_ARGUMENT:",
    "Detected at node ..." and stack lines, {{function_node ...}}, [[{{node ...}}]]), shortened
    at a word."""
    for line in str(e).splitlines():
        line = re.sub(r"\{\{[^}]*\}\}|\[\[[^\]]*\]\]", "", line).strip(" \t;:")
        line = re.sub(r"^\(\d+\) [A-Z_]+:\s*", "", line)   # one of several devices' errors: "(0) INVALID_ARGUMENT:"
        if (line and not line.startswith(_WRAPPING) and not line.startswith(("File ", "<"))
                and not _ROOT_ERRORS.match(line)):
            break
    else:
        return type(e).__name__
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."


_WRAPPING = ("Graph execution error", "Detected at node", "Detected unsupported operations")
_ROOT_ERRORS = re.compile(r"\d+ root error\(s\) found")
