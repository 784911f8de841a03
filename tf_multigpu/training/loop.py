"""The training run in three parts, for every strategy: build, loop, finish.

`build_run` (run.py) checks the flags against the devices, builds the model and optimizer in
the parallelism's scope, restores the latest checkpoint and compiles the step, writing
nothing. The loop runs windows of steps and, after each, the actions that are due
(cadence.py: record, report, evaluate, checkpoint, show progress, the preemption vote).
`finish_run` exports the trained network and writes the summary. The same three parts run
single-device, data parallel, and model and hybrid parallel training.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import tensorflow as tf
from absl import logging

from tf_multigpu.config import Config, check_previous_run
from tf_multigpu.errors import UsageError, error_reason
from tf_multigpu.export import export_saved_model
from tf_multigpu.models import build_model
from tf_multigpu.parallel.memory import host_bytes
from tf_multigpu.profiling.memory_measured import MemoryMeter, malloc_advice
from tf_multigpu.training.cadence import (
    Evaluate,
    PreemptionVote,
    RecordTraining,
    ReportProfile,
    Results,
    SaveCheckpoint,
    ShowProgress,
    make_profiler,
    run_windows,
    write_scalars,
)
from tf_multigpu.training.preemption import StopOnSignal
from tf_multigpu.training.run import Run, build_run
from tf_multigpu.training.run_dir import writing_alone


def train(cfg: Config, devices: list[str], runtime=None, *, source=None, prediction=None) -> dict:
    """Trains as `cfg` says on `devices` (or every worker's, given a started multi-worker
    `runtime`); writes everything under cfg.run_dir; returns the summary.

    `source`: the data set, if the caller loaded it already. `prediction`: for a run whose
    --strategy=auto the entry point resolved, the planner's prediction (planner/auto.py),
    which the summary holds beside the measured step time. SIGTERM on any worker stops every
    worker after the same step, with a checkpoint there: raises Preempted."""
    if not cfg.run_dir:
        raise ValueError("train() writes a run directory: give the Config a run_dir (build_run builds without one)")
    started = time.perf_counter()
    check_previous_run(cfg)   # a run_dir that is a file, or holds another run: said before anything is made
    # The chief takes the run directory for itself before it reads the checkpoint it resumes.
    alone = writing_alone(os.path.abspath(cfg.run_dir)) if runtime is None or runtime.is_chief \
        else contextlib.nullcontext()
    with alone:
        return _build_and_train(cfg, devices, runtime, source, prediction, started)


def _build_and_train(cfg, devices, runtime, source, prediction, started) -> dict:
    run = build_run(cfg, devices, runtime, source=source)
    with start_writing(run) as writer:
        results, profiler = Results(step=run.start_step), make_profiler(run)
        checkpoint = SaveCheckpoint(run, every=cfg.checkpoint_every)
        with StopOnSignal.install() as stop, _own_line(run.role.is_chief):
            run_windows(run, profiler, [
                ReportProfile(profiler, writer, results),
                RecordTraining(run, writer, results),
                Evaluate(run, writer, results, every=cfg.eval_every or run.steps_per_epoch),
                # The vote before the periodic checkpoint: a SIGTERM that arrives while a window's
                # checkpoint is written stops the workers after the next window, not this one.
                PreemptionVote(run, stop, checkpoint),
                checkpoint,
                ShowProgress(run, results),
            ], results)
        return finish_run(run, writer, results, started, prediction)


@contextlib.contextmanager
def _own_line(shows_progress: bool):
    """Ends the progress bar's line when the loop stops on an error, so that the error's one
    line (stderr) is not glued to the end of the bar (stdout)."""
    try:
        yield
    except BaseException:
        if shows_progress:
            print(flush=True)
        raise


@contextlib.contextmanager
def start_writing(run: Run):
    """Everything is checked and any earlier state restored: from here on the run writes.
    Writes config.json and prints the banner (the chief: one per run, not one per worker),
    and, after a restore from a checkpoint the state file did not name, rewrites
    checkpoints/checkpoint (`WorkerRole.name_checkpoints`); yields the TensorBoard writer (a
    no-op one on the other workers)."""
    try:
        run.role.write_config(run.cfg, run.paths)
    except (OSError, tf.errors.OpError) as e:   # a read-only or full file system
        raise UsageError(f"cannot write to --run_dir={run.cfg.run_dir} ({error_reason(e)}): choose a "
                         "writable --run_dir, or free space; nothing in it has been changed") from None
    if run.manager:
        run.manager = run.role.name_checkpoints(run.manager)
    if run.role.is_chief:
        print(run.banner(), flush=True)
    writer = run.role.summary_writer(run.paths)
    write_scalars(writer, "memory_per_device", run.start_step, {f"{k}_bytes": v for k, v in run.memory.items()})
    yield writer


def finish_run(run: Run, writer, results: Results, started: float, prediction=None) -> dict:
    """Exports the trained network (the chief) and writes summary.json; returns the summary."""
    cfg, source, role = run.cfg, run.source, run.role
    test = results.test or run.evaluate()   # --steps=0, or resumed at the end: still report the accuracy
    memory_measured = run.meter.measured()
    advice = malloc_advice(memory_measured)
    if advice and role.is_chief:
        logging.warning(advice)
    write_scalars(writer, "memory_measured", results.step, MemoryMeter.scalars(memory_measured))
    writer.flush()

    # Every worker builds the copy (gathering split weights is collective); the chief exports.
    plain = _plain_copy(run) if cfg.export else None
    export_dir = None if not (cfg.export and role.is_chief) else export_saved_model(
        plain, source, run.paths.export,
        metadata={"config": cfg.to_dict(), "class_names": list(source.class_names),
                  "input_shape": list(source.image_shape), "pixel_dtype": source.pixel_dtype.name,
                  "metrics": test, "step": run.total_steps},
        checkpoint=run.manager.latest_checkpoint)
    summary = {
        "step": run.total_steps, "strategy": run.par.name, "devices": run.par.devices,
        "model": cfg.model, "dataset": source.name, "global_batch": cfg.batch_size,
        **{k: results.train.get(k) for k in ("loss", "accuracy")}, **results.throughput.summary(),
        **test, "wall_time_s": time.perf_counter() - started, "export_dir": export_dir,
        "memory_per_device_bytes": run.memory, "memory_measured": memory_measured,
        "memory_host_bytes": host_bytes(source.image_shape, cfg.batch_size // run.par.input_shard[1]),
        "skipped_images": len(source.skipped),
    }
    summary.update(_measured_earlier(run, summary))
    if results.communication:
        report = results.communication
        summary["communication"] = {"mean": report["mean"], "report": run.paths.comm_report + ".md",
                                    "moved_bytes_per_device": {k: v["moved_bytes"] for k, v in
                                                               report["bytes_per_device"].items()}}
    if prediction:
        summary["plan"] = prediction.with_measurement(summary["step_time_s"])
    role.write_summary(run.paths, summary)
    role.close()
    return summary


# What only training measures: a run that trains no step (resumed at its end) measures none.
_TRAINING_MEASUREMENTS = ("loss", "accuracy", "examples_per_sec", "step_time_s", "communication")


def _measured_earlier(run: Run, summary: dict) -> dict:
    """The earlier summary's training measurements, where this run trained no step and so has
    none (a command run again on a finished run): they were rewritten as null, the
    profiled run's communication dropped. Only from a summary of the same step, strategy and
    devices: a run stopped after its last checkpoint but before its summary, or resumed on
    other devices, measured something else."""
    if run.start_step < run.total_steps or not run.paths:
        return {}
    try:
        with open(run.paths.summary) as f:
            earlier = json.load(f)
    except (OSError, ValueError):   # none, or unreadable: nothing to keep
        return {}
    if not isinstance(earlier, dict) or any(earlier.get(k) != summary[k] for k in ("step", "strategy", "devices")):
        return {}
    return {k: earlier[k] for k in _TRAINING_MEASUREMENTS if summary.get(k) is None and earlier.get(k) is not None}


def _plain_copy(run: Run):
    """A fresh single-device model holding the trained values (what we export)."""
    plain = build_model(run.cfg.model, run.source.image_shape, run.source.num_classes)
    plain.set_weights([run.par.to_numpy(v) for v in run.model.weights])
    return plain
