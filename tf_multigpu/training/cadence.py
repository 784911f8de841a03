"""When things happen in a training run: windows of steps, and the actions after them.

The loop runs the compiled step over a window of steps in one call, so the host waits once
per window, then hands the window to each action that is due, in order. As with Orbit's
controller actions and flax's periodic actions, each action says when it fires (every N
steps and at the last step, or after every window) and what it does; a window never runs past
a step at which an action is due. The actions here are the loop's: record the training
metrics, write the communication report, evaluate, save a checkpoint, show progress, and the
preemption vote.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time

import keras
import tensorflow as tf
from absl import logging

from tf_multigpu.data.throughput import InputCheck
from tf_multigpu.errors import UsageError, error_reason
from tf_multigpu.parallel.base import host_scalars
from tf_multigpu.profiling.step_profiler import StepProfiler
from tf_multigpu.training.preemption import Preempted


@dataclasses.dataclass
class Window:
    """Steps start+1 .. end, just run."""

    start: int
    end: int
    sums: dict          # the step's scalars summed over the window: loss_sum, correct, count
    seconds: float      # from dispatch until the sums were on the host
    traced: bool        # run under the profiler (slower than usual)
    learning_rate: float

    @property
    def steps(self) -> int:
        return self.end - self.start

    def metrics(self) -> dict:
        return {"loss": self.sums["loss_sum"] / self.sums["count"],
                "accuracy": self.sums["correct"] / self.sums["count"],
                "examples_per_sec": self.sums["count"] / self.seconds,
                "step_time_s": self.seconds / self.steps,
                "learning_rate": self.learning_rate}


@dataclasses.dataclass
class Results:
    """What the loop has measured so far; the actions fill it in, finish_run reports it."""

    step: int                                   # the last step run (the start step before any)
    throughput: Throughput = dataclasses.field(default_factory=lambda: Throughput())
    train: dict = dataclasses.field(default_factory=dict)   # the last window's metrics
    test: dict = dataclasses.field(default_factory=dict)    # the last evaluation's
    tested_at: int | None = None                # the step of the last evaluation
    communication: dict | None = None           # the profiled steps' report (profiling/report.py)


class Action:
    """Something the loop does after a window. `every` > 0: at multiples of `every` and at the
    last step (windows end there); 0: after every window."""

    every = 0

    def due(self, step: int, last: int) -> bool:
        return not self.every or step % self.every == 0 or step == last

    def __call__(self, window: Window) -> None:
        raise NotImplementedError


def run_windows(run, profiler: StepProfiler | None, actions: list[Action], results: Results) -> None:
    """Trains from run.start_step to run.total_steps: windows of steps, each followed by the
    actions due after it."""
    step, last = run.start_step, run.total_steps
    batches = run.train_batches()
    while step < last:
        size = min([a.every - step % a.every for a in actions if a.every] + [last - step])
        window = _run_window(run, profiler, batches, step, size)
        step = results.step = window.end
        for action in actions:
            if action.due(step, last):
                action(window)


def _run_window(run, profiler, batches, step: int, size: int) -> Window:
    """Steps step+1 .. step+size (cut short where the profiler traces steps one by one)."""
    traced = profiler is not None and profiler.profiles(step)
    started = time.perf_counter()
    if profiler:
        size = profiler.window(step, size)
        sums = profiler.run(run.train_fn, batches, step, size)
    else:
        sums = host_scalars(run.train_fn(batches, tf.constant(size)))   # the sync point
    return Window(step, step + size, sums, time.perf_counter() - started, traced,
                  float(run.optimizer.learning_rate.numpy()))


def make_profiler(run) -> StepProfiler | None:
    """The StepProfiler for --profile_steps (None without it, or when the run resumes past it)."""
    if not run.cfg.profile_range:
        return None
    first = run.cfg.profile_range[0]
    if first <= run.start_step:
        logging.warning("--profile_steps=%s: the run resumes at step %d, past step %d; nothing is profiled",
                        run.cfg.profile_steps, run.start_step, first)
        return None
    par = run.par
    return StepProfiler(run.cfg.profile_range, run.paths.tensorboard, run.paths.comm_report, par, run.model, meta={
        "strategy": par.name, "devices": par.devices, "mesh": par.mesh_shape,
        "global_batch": run.cfg.batch_size, "model": run.cfg.model})


# -- the actions, in the order the loop runs them ----------------------------------------------

class RecordTraining(Action):
    """Every window: the training metrics to TensorBoard, its time to the throughput (unless
    traced: tracing slows steps down), and once, if the input pipeline cannot keep up, a note."""

    def __init__(self, run, writer, results: Results):
        self.run, self.writer, self.results = run, writer, results
        self.every = run.cfg.log_every   # windows end at least this often
        # This process's rows, timed alone, once, when a window after the warm-up asks.
        self.input_check = InputCheck(run.local_batches, share=1 / run.par.input_shard[1])

    def due(self, step, last):
        return True

    def __call__(self, window):
        first = window.start == self.run.start_step
        if not window.traced:
            self.results.throughput.add(window.sums["count"], window.seconds, window.steps, warmup=first)
        self.results.train = window.metrics()
        write_scalars(self.writer, "train", window.end, self.results.train)
        if not first and (note := self.input_check.verdict(self.results.train["examples_per_sec"])):
            print(note, flush=True)   # once: the first timed window after warm-up that is input-bound


class ReportProfile(Action):
    """After the last profiled step: the communication report (profiling/report.py)."""

    def __init__(self, profiler: StepProfiler | None, writer, results: Results):
        self.profiler, self.writer, self.results = profiler, writer, results

    def __call__(self, window):
        if self.profiler and (report := self.profiler.finish(self.writer, window.end)):
            self.results.communication = report


class Evaluate(Action):
    """Every `every` steps and at the end: loss and accuracy on the test split."""

    def __init__(self, run, writer, results: Results, every: int):
        self.run, self.writer, self.results, self.every = run, writer, results, every

    def __call__(self, window):
        self.results.test, self.results.tested_at = self.run.evaluate(), window.end
        write_scalars(self.writer, "test", window.end, self.results.test)


# What the file system raises when a checkpoint cannot be written. Other errors of a save (a
# peer lost in a multi-worker save: UnavailableError, DeadlineExceededError) keep their own report.
_WRITE_ERRORS = (OSError, tf.errors.ResourceExhaustedError, tf.errors.PermissionDeniedError)


class SaveCheckpoint(Action):
    """Every `every` steps and at the end (and when the workers stop early: `save`)."""

    def __init__(self, run, every: int):
        self.run, self.every = run, every
        self.saved_at = None

    def __call__(self, window):
        self.save(window.end)

    def save(self, step: int) -> None:
        if self.run.manager and self.saved_at != step:
            try:
                self.run.manager.save(checkpoint_number=step)
            except _WRITE_ERRORS as e:   # a full disk is ResourceExhaustedError: not device memory
                # The half-written checkpoint is TensorFlow's staging directory; the earlier ones are whole.
                for temp in tf.io.gfile.glob(f"{self.run.manager.directory}/ckpt-{step}_temp*"):
                    shutil.rmtree(temp, ignore_errors=True)
                raise UsageError(f"cannot save checkpoint {step} in {self.run.manager.directory} "
                                 f"({error_reason(e)}): free space or make it writable, then run the same "
                                 "command again to resume from the last checkpoint") from None
            self.saved_at = step


class ShowProgress(Action):
    """Every window: the progress bar (loss, accuracy, examples/s, and test accuracy when the
    window ended with an evaluation)."""

    def __init__(self, run, results: Results):
        self.results = results
        self.bar = keras.utils.Progbar(run.total_steps, interval=0.05 if sys.stdout.isatty() else 10.0,
                                       stateful_metrics=["loss", "accuracy", "test_accuracy", "examples/s"])
        self.bar.update(run.start_step)

    def __call__(self, window):
        train = self.results.train
        shown = [("loss", train["loss"]), ("accuracy", train["accuracy"]), ("examples/s", train["examples_per_sec"])]
        if self.results.tested_at == window.end:
            shown.append(("test_accuracy", self.results.test["test_accuracy"]))
        self.bar.update(window.end, shown)


class PreemptionVote(Action):
    """Every window, on every worker: whether any worker got SIGTERM (one collective, so all
    get the same answer); if so, all save a checkpoint at this step and raise Preempted."""

    def __init__(self, run, stop, checkpoint: SaveCheckpoint):
        self.run, self.stop, self.checkpoint = run, stop, checkpoint

    def __call__(self, window):
        if self.stop.agreed(self.run.par) and window.end < self.run.total_steps:
            self.checkpoint.save(window.end)
            self.run.role.close()
            raise Preempted(window.end, f"{self.run.paths.checkpoints}/ckpt-{window.end}",   # the chief's
                            self.stop.signum)


class Throughput:
    """Examples/s and step time over many windows; the first window is warm-up."""

    def __init__(self):
        self.examples = self.seconds = self.steps = 0
        self.first = None

    def add(self, examples, seconds, steps, warmup=False):
        if warmup:
            self.first = (examples, seconds, steps)
        else:
            self.examples, self.seconds, self.steps = (
                self.examples + examples, self.seconds + seconds, self.steps + steps)

    def summary(self) -> dict:
        examples, seconds, steps = (self.examples, self.seconds, self.steps) if self.steps else (
            self.first or (0, 0, 0))
        if not steps:
            return {"examples_per_sec": None, "step_time_s": None}
        return {"examples_per_sec": examples / seconds, "step_time_s": seconds / steps}


def write_scalars(writer, prefix: str, step: int, values: dict) -> None:
    with writer.as_default(step=step):
        for name, value in values.items():
            tf.summary.scalar(f"{prefix}/{name}", value)
