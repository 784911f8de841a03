"""What a run does with its directory: refuse an unusable one (`check_previous_run`, in config:
the entry point applies it before TensorFlow starts), resume from what an earlier run
left (rewriting the checkpoint state file once the run writes, where the restore had to
fall back to the newest checkpoint on disk), hold the directory while training it, write JSON
atomically (through config's `write_atomically`). Where each file lives is
`config.RunPaths`'s alone (export reads the same layout without importing training).

Nothing here deletes or overwrites an earlier run's results before the new run is known to
be valid: a config that computes something else, or an unreadable checkpoint, is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os

import tensorflow as tf
from absl import logging

from tf_multigpu.config import RunPaths
from tf_multigpu.config.config import checkpoints_on_disk, write_atomically
from tf_multigpu.errors import UsageError, error_reason

KEEP_CHECKPOINTS = 3
LOCK_FILE = ".training.lock"   # held while a run writes the directory (`writing_alone`)


def restore_latest(checkpoint: tf.train.Checkpoint, paths: RunPaths) -> tuple[tf.train.CheckpointManager, list[str]]:
    """A CheckpointManager for the run; restores its latest checkpoint if there is one.

    The latest is the one the manager's state file (`checkpoints/checkpoint`) names, if its
    files exist; otherwise the newest checkpoint on disk, with a warning. Trusting the state
    file alone made a run whose state file was lost or garbled start again from step 0 and
    save over the checkpoints it did not see, and a checkpoint moved away (as the error below
    advises) kept being asked for.

    Returns (the manager, the checkpoints on disk its state file should name but does not: []
    unless the fallback was taken). Nothing is written here; `name_checkpoints` writes that
    state file once the run starts writing."""
    try:
        manager = tf.train.CheckpointManager(checkpoint, paths.checkpoints, max_to_keep=KEEP_CHECKPOINTS)
    except ValueError as e:   # an empty state file parses, then TensorFlow refuses it ("Invalid checkpoint state")
        raise UsageError(f"{paths.checkpoints}/checkpoint is empty or invalid ({error_reason(e)}): delete it, and "
                         "the run resumes from the newest checkpoint there") from None
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
        except (AssertionError, ValueError) as e:   # values missing or of other shapes: another model
            raise UsageError(f"checkpoint {latest} does not fit this run's model ({error_reason(e)}): its "
                             "--model's code changed since the run saved it? restore that code, or use a new "
                             "--run_dir") from None
        except Exception as e:  # noqa: BLE001  truncated files raise IndexError, others OpError...
            others = [prefix for prefix in on_disk if prefix != latest]   # what a run would resume from next
            name = os.path.basename(latest)
            fix = (f"move its files ({name}.*) out of {paths.checkpoints} to resume from "
                   f"{os.path.basename(others[-1])}, or use a new --run_dir" if others else
                   f"it is the run's only checkpoint: use a new --run_dir, or move its files ({name}.*) and "
                   f"{paths.checkpoints}/checkpoint out to train again from step 0")
            raise UsageError(f"checkpoint {latest} cannot be restored ({error_reason(e)}): {fix}") from None
    return manager, (on_disk if latest and latest != named_here else [])   # the fallback's latest: on_disk[-1]


def name_checkpoints(checkpoint: tf.train.Checkpoint, paths: RunPaths, prefixes: list[str]):
    """Rewrites the state file to name `prefixes` (oldest first; the last is the latest), as the
    manager would have, and returns a manager that knows them. After a fallback restore the
    manager knew none: the export of a run that saved nothing new named no checkpoint, and the
    older checkpoints were never deleted as newer ones came (max_to_keep). With their index
    files' times: the manager deletes only checkpoints with a time (those without one count as
    kept for good, like keep_checkpoint_every_n_hours')."""
    directory = paths.checkpoints
    lines = [f'model_checkpoint_path: "{os.path.basename(prefixes[-1])}"']
    lines += [f'all_model_checkpoint_paths: "{os.path.basename(p)}"' for p in prefixes]
    lines += [f"all_model_checkpoint_timestamps: {os.path.getmtime(p + '.index')!r}" for p in prefixes]
    try:
        write_atomically(os.path.join(directory, "checkpoint"), "\n".join(lines) + "\n")
    except OSError as e:   # a read-only or full checkpoints directory
        raise UsageError(f"cannot write {directory}/checkpoint ({error_reason(e)}): make {directory} writable, "
                         "or free space; nothing in it has been changed") from None
    return tf.train.CheckpointManager(checkpoint, directory, max_to_keep=KEEP_CHECKPOINTS)


@contextlib.contextmanager
def writing_alone(root: str):
    """Holds an exclusive lock on the run directory while this process trains it. A second run
    of the same --run_dir (a command started twice, a forgotten background job) restored the
    same checkpoint and saved its own over this run's, unrefused. flock: the kernel releases
    it when the process dies, so a killed run leaves no stale lock (the file may stay; it
    holds the last owner's process id, for the message). A file system without flock (NFS
    without lockd, Lustre without -o flock) runs unlocked, with a warning.

    A directory this call made is removed again if the run leaves it empty (a run refused
    while it builds)."""
    made = not os.path.exists(root)
    path = os.path.join(root, LOCK_FILE)
    try:
        while True:
            try:
                os.makedirs(root, exist_ok=True)
                handle = open(path, "a+")
            except OSError as e:   # a read-only or full file system
                raise UsageError(f"cannot write to --run_dir={root} ({error_reason(e)}): choose a writable "
                                 "--run_dir, or free space; nothing in it has been changed") from None
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:   # held
                handle.seek(0)
                owner = handle.read().strip()
                handle.close()
                by = f"another process (pid {owner})" if owner else "another process"
                raise UsageError(f"--run_dir={root} is being trained by {by}: wait for it to end or stop it, "
                                 "or use another --run_dir") from None
            except OSError as e:   # no locks on this file system
                logging.warning("--run_dir=%s: cannot lock %s (%s); nothing stops a second run on it", root, path, e)
                break
            # The owner before us removes the file as it ends; a lock taken on the file it removed
            # is no lock (a third run would make a new file): take it again on the file there now.
            if os.path.exists(path) and os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino:
                break
            handle.close()
        with handle:
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            try:
                yield
            finally:
                with contextlib.suppress(OSError):
                    os.remove(path)   # while still holding it (see the check above)
    finally:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(root)   # only if empty


def write_json(path: str, values: dict) -> None:
    """Writes `values` atomically (a crash leaves the previous file, never half of one)."""
    write_atomically(path, json.dumps(values, indent=2, sort_keys=True) + "\n")
