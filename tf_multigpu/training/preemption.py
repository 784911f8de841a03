"""Stopping on SIGTERM (or Ctrl-C) at a step every worker agrees on, after a checkpoint.

A scheduler that preempts a job (Kubernetes, Slurm, a spot VM) sends SIGTERM to some of its
processes, at different times. Every worker must stop after the SAME step, or the
checkpoint would mix steps. The handler only raises a local flag; at the end of every
training window (the loop's sync point) all workers combine their flags with one tiny
all-reduce (max) on the same collective fabric as the gradients, so either all of them see a
stop request after step N or none does. They then save checkpoint N and exit with
PREEMPTED_EXIT_CODE; rerunning the same command resumes from step N exactly.

Ctrl-C (SIGINT) is handled the same way, with exit status 130 (128 + SIGINT, what a shell
reports for it): Python's default turned it into a KeyboardInterrupt traceback that lost
every step since the last periodic checkpoint. A second one stops without the checkpoint, as
before. (Python runs handlers between steps' windows, so two Ctrl-C within one window are a
first and a second.) A signal the process ignores (SIGINT of a background job) stays ignored.

We do not use `tf.distribute.experimental.PreemptionCheckpointHandler` (BUILD_NOTES.md,
"Several workers"): it counts its own "run calls" in a variable it adds to our checkpoint,
writes through its own CheckpointManager unless given a save_fn, is a silent no-op on GCP CPU
VMs ("PreemptionCheckpointHandler does not support usage with TPU or CPU device on GCP"),
and probes the GCE metadata server at start. The all-reduce works the same for
MultiWorkerMirroredStrategy, DTensor meshes and one process.
"""

from __future__ import annotations

import os
import signal

PREEMPTED_EXIT_CODE = 143   # 128 + SIGTERM: what a terminated process reports; schedulers restart it
EXIT_CODES = {signal.SIGTERM: PREEMPTED_EXIT_CODE, signal.SIGINT: 130}
SIGNALS = tuple(EXIT_CODES)


class Preempted(Exception):
    """Training stopped on SIGTERM or SIGINT after saving a checkpoint every worker agreed on;
    `exit_code` is the status the process reports for that signal."""

    def __init__(self, step: int, checkpoint: str, signum: int = signal.SIGTERM):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}, saved {checkpoint}: "
                         "run the same command again to resume")
        self.step, self.checkpoint, self.exit_code = step, checkpoint, EXIT_CODES[signum]


class StopOnSignal:
    """While installed, a first SIGTERM or SIGINT raises a flag instead of killing the process;
    a second one does what it did before (a worker stuck outside the loop can still be
    stopped, and a second Ctrl-C interrupts without a checkpoint).

    `with StopOnSignal.install() as stop:` uninstalls it on the way out, errors included."""

    def __init__(self):
        self.requested = False
        self.signum = signal.SIGTERM   # the first signal received
        self._previous = {}

    @classmethod
    def install(cls) -> StopOnSignal:
        stop = cls()
        for signum in SIGNALS:
            try:
                if signal.getsignal(signum) is signal.SIG_IGN:   # e.g. SIGINT of `cmd &` in a script: not ours
                    continue
                stop._previous[signum] = signal.signal(signum, stop._handle)
            except ValueError:   # not the main thread (e.g. a notebook's worker thread): keep the default
                pass
        return stop

    def __enter__(self) -> StopOnSignal:
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            # None: a handler installed from C, which Python cannot put back; the default then
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum, frame):
        if self.requested:
            self.uninstall()
            signal.raise_signal(signum)
            return
        self.requested, self.signum = True, signum
        if signum == signal.SIGINT:   # someone at a terminal: say that it was heard
            # os.write, not print: a handler that interrupts a write to stderr must not write through
            # the same buffered file ("reentrant call").
            os.write(2, b"\nSIGINT: stopping after the current steps, with a checkpoint (another Ctrl-C "
                        b"stops without one)\n")

    def agreed(self, par) -> bool:
        """True on every worker if any worker has been asked to stop (a collective call:
        every worker must make it at the same point)."""
        return par.any_worker(self.requested)
