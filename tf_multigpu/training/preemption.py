"""Stopping on SIGTERM at a step every worker agrees on, after a checkpoint.

A scheduler that preempts a job (Kubernetes, Slurm, a spot VM) sends SIGTERM to some of its
processes, at different times. Every worker must stop after the SAME step, or the
checkpoint would mix steps. The handler only raises a local flag; at the end of every
training window (the loop's sync point) all workers combine their flags with one tiny
all-reduce (max) on the same collective fabric as the gradients, so either all of them see a
stop request after step N or none does. They then save checkpoint N and exit with
PREEMPTED_EXIT_CODE; rerunning the same command resumes from step N exactly.

We do not use `tf.distribute.experimental.PreemptionCheckpointHandler` (BUILD_NOTES.md,
"Several workers"): it counts its own "run calls" in a variable it adds to our checkpoint,
writes through its own CheckpointManager unless given a save_fn, is a silent no-op on GCP CPU
VMs ("PreemptionCheckpointHandler does not support usage with TPU or CPU device on GCP"),
and probes the GCE metadata server at start. The all-reduce works the same for
MultiWorkerMirroredStrategy, DTensor meshes and one process.
"""

from __future__ import annotations

import signal

PREEMPTED_EXIT_CODE = 143   # 128 + SIGTERM: what a terminated process reports; schedulers restart it


class Preempted(Exception):
    """Training stopped on SIGTERM after saving a checkpoint every worker agreed on."""

    def __init__(self, step: int, checkpoint: str):
        super().__init__(f"stopped by SIGTERM after step {step}, saved {checkpoint}: "
                         "run the same command again to resume")
        self.step, self.checkpoint = step, checkpoint


class StopOnSigterm:
    """While installed, a first SIGTERM raises a flag instead of killing the process; a
    second one kills it as usual (a worker stuck outside the loop can still be stopped).

    `with StopOnSigterm.install() as stop:` uninstalls it on the way out, errors included."""

    def __init__(self):
        self.requested = False
        self._previous = None

    @classmethod
    def install(cls) -> StopOnSigterm:
        stop = cls()
        try:
            stop._previous = signal.signal(signal.SIGTERM, stop._handle)
        except ValueError:   # not the main thread (e.g. a notebook's worker thread): keep the default
            pass
        return stop

    def __enter__(self) -> StopOnSigterm:
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            self.uninstall()
            signal.raise_signal(signum)
        self.requested = True

    def agreed(self, par) -> bool:
        """True on every worker if any worker has been asked to stop (a collective call:
        every worker must make it at the same point)."""
        return par.any_worker(self.requested)
