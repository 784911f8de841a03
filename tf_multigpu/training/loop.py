"""The training loop: when things happen (log, evaluate, checkpoint, export), for every strategy.

It builds the model and optimizer inside the parallelism's scope, feeds it the seeded
resumable pipeline, and drives the compiled step. The same loop runs single-device, data
parallel and (through another parallelism object) model and hybrid parallel training.
"""

from __future__ import annotations

import math
import sys
import time

import keras
import tensorflow as tf
from absl import logging

from tf_multigpu.config import Config, check_plan
from tf_multigpu.data import load_source
from tf_multigpu.data.pipeline import steps_per_epoch, test_dataset, train_dataset
from tf_multigpu.data.throughput import InputCheck
from tf_multigpu.errors import DoesNotFit, UsageError
from tf_multigpu.export import export_saved_model
from tf_multigpu.models import build_model, get_factory
from tf_multigpu.parallel import make_parallelism
from tf_multigpu.parallel.base import host_scalars
from tf_multigpu.parallel.memory import bytes_per_device
from tf_multigpu.parallel.stateless_dropout import use_step
from tf_multigpu.planner.auto import resolve_strategy, with_measurement
from tf_multigpu.profiling.memory_measured import MemoryMeter
from tf_multigpu.profiling.step_profiler import StepProfiler
from tf_multigpu.training import run_dir
from tf_multigpu.training.optimizer import MomentumSGD, learning_rate_schedule
from tf_multigpu.training.preemption import Preempted, StopOnSigterm
from tf_multigpu.training.step import make_eval_step, make_train_step
from tf_multigpu.training.workers import WorkerRole


def train(cfg: Config, devices: list[str], runtime=None) -> dict:
    """Trains as `cfg` says on `devices` (or every worker's, given a started multi-worker
    `runtime`); writes everything under cfg.run_dir; returns the summary.

    SIGTERM on any worker stops every worker after the same step, with a checkpoint there:
    raises Preempted."""
    started = time.perf_counter()
    get_factory(cfg.model)   # an unknown model is reported before anything is built
    source = load_source(cfg.dataset, cfg.data_dir, cfg.image_size, augment=cfg.augment,
                         test_fraction=cfg.test_fraction, skip_bad_images=cfg.skip_bad_images,
                         input_threads=cfg.input_threads)
    cfg, plan = resolve_strategy(cfg, devices, source)   # --strategy=auto: the planner's top plan
    check_plan(cfg, runtime.all_devices if runtime else devices, runtime.cluster if runtime else None)
    par = make_parallelism(cfg.strategy, devices, cfg.batch_size, cfg.all_reduce, cfg.mesh_shape,
                           cfg.layout, cfg.layout_rule_list, runtime=runtime, batchnorm=cfg.batchnorm)
    role = WorkerRole(runtime, shared_checkpoints=cfg.strategy in ("model", "hybrid"))
    per_epoch = steps_per_epoch(source, cfg.batch_size)
    paths = run_dir.check_previous_run(cfg)
    total_steps = cfg.steps if cfg.steps is not None else math.ceil(cfg.epochs * per_epoch)

    meter = MemoryMeter(par.devices)   # before the model: the baseline its measurement starts from
    model, optimizer = build_model_and_optimizer(cfg, par, source, total_steps)
    # Dropout masks are a function of the step (parallel/stateless_dropout.py), which the
    # optimizer's iteration count restores. model.variables may still hold other layers' RNG
    # states (GaussianNoise, a user's SeedGenerator); saving them makes a resumed run draw what
    # an uninterrupted one would. (Checkpoints from before StatelessDropout still load: their
    # Dropout seed states are values that no object asks for, which a restore ignores.)
    weight_ids = {id(w) for w in model.weights}
    rng_states = [v for v in model.variables if id(v) not in weight_ids]
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, rng_states=rng_states)
    manager = role.checkpoint_manager(checkpoint, paths)
    start = int(optimizer.iterations.numpy())
    profiler = _profiler(cfg, paths, par, model, start, total_steps)

    memory = bytes_per_device(par.plan, cfg.batch_size, slots_per_parameter=1 if cfg.momentum else 0) \
        if par.plan else {}   # a subclassed model (data parallel) has no graph to estimate from
    _check_fits(cfg, memory, par)
    # Input is valid and any earlier state restored: from here on the run writes.
    role.write_config(cfg, paths)
    if role.is_chief:   # one banner per run, not one per worker
        print(f"{par.name} parallelism on {len(par.devices)} device(s): {', '.join(par.devices)}; "
              f"{source.name} {source.image_shape}, {cfg.model} ({model.count_params():,} parameters), "
              f"global batch {cfg.batch_size}, steps {start}..{total_steps}; per device: "
              + (f"{memory['parameters'] / 2**20:.1f} MiB parameters, {memory['total'] / 2**20:.1f} MiB in all"
                 if memory else "no memory estimate (subclassed model)"), flush=True)

    train_iter = iter(par.distribute(lambda b: train_dataset(
        source, seed=cfg.seed, global_batch=cfg.batch_size, batch_size=b, start_step=start,
        shard=par.input_shard)))
    test_data = par.distribute(lambda b: test_dataset(source, global_batch=cfg.batch_size, batch_size=b,
                                                      shard=par.input_shard))
    test_batches = math.ceil(source.num_test / cfg.batch_size)
    input_check = InputCheck(lambda: train_dataset(   # this process's rows, timed alone, once
        source, seed=cfg.seed, global_batch=cfg.batch_size, batch_size=cfg.batch_size // par.input_shard[1],
        start_step=start, shard=par.input_shard), share=1 / par.input_shard[1])
    train_fn = par.compile(make_train_step(model, optimizer, cfg.batch_size, jit_compile=cfg.xla))
    eval_fn = par.compile(make_eval_step(model))

    def evaluate():
        sums = host_scalars(eval_fn(iter(test_data), tf.constant(test_batches)))
        return {"test_loss": sums["loss_sum"] / sums["count"], "test_accuracy": sums["correct"] / sums["count"]}

    writer = role.summary_writer(paths)
    _write_scalars(writer, "memory_per_device", start, {f"{k}_bytes": v for k, v in memory.items()})
    bar = keras.utils.Progbar(total_steps, interval=0.05 if sys.stdout.isatty() else 10.0,
                              stateful_metrics=["loss", "accuracy", "test_accuracy", "examples/s"])
    bar.update(start)
    eval_every = cfg.eval_every or per_epoch
    steady, train_metrics, test_metrics = Throughput(), {}, {}
    step = start
    stop = StopOnSigterm.install()
    try:
        while step < total_steps:
            # Run up to the next log, evaluation, checkpoint or the end in one call.
            window = min(_to_next(step, cfg.log_every), _to_next(step, eval_every),
                         _to_next(step, cfg.checkpoint_every), total_steps - step)
            traced = profiler is not None and profiler.profiles(step)
            window_start = time.perf_counter()
            if profiler:
                window = profiler.window(step, window)
                sums = profiler.run(train_fn, train_iter, step, window)
            else:
                sums = host_scalars(train_fn(train_iter, tf.constant(window)))   # the sync point
            seconds = time.perf_counter() - window_start
            if not traced:   # tracing slows steps down: keep them out of the throughput
                steady.add(sums["count"], seconds, window, warmup=step == start)
            step += window
            if profiler:
                profiler.finish(writer, step)
            train_metrics = {
                "loss": sums["loss_sum"] / sums["count"],
                "accuracy": sums["correct"] / sums["count"],
                "examples_per_sec": sums["count"] / seconds,
                "step_time_s": seconds / window,
                "learning_rate": float(optimizer.learning_rate.numpy()),
            }
            _write_scalars(writer, "train", step, train_metrics)
            if step - window > start and (note := input_check.verdict(train_metrics["examples_per_sec"])):
                print(note, flush=True)   # once: the first timed window after warm-up that is input-bound
            shown = [("loss", train_metrics["loss"]), ("accuracy", train_metrics["accuracy"]),
                     ("examples/s", train_metrics["examples_per_sec"])]
            if step % eval_every == 0 or step == total_steps:
                test_metrics = evaluate()
                _write_scalars(writer, "test", step, test_metrics)
                shown.append(("test_accuracy", test_metrics["test_accuracy"]))
            stopping = stop.agreed(par) and step < total_steps   # the same answer on every worker
            if step % cfg.checkpoint_every == 0 or step == total_steps or stopping:
                manager.save(checkpoint_number=step)
            bar.update(step, shown)
            if stopping:
                role.close()
                raise Preempted(step, f"{paths.checkpoints}/ckpt-{step}")   # the chief's, which all restore
    finally:   # also on Preempted and errors: SIGTERM kills as usual again
        stop.uninstall()
    if not test_metrics:   # --steps=0, or resumed at the end: still report the model's accuracy
        test_metrics = evaluate()
    memory_measured = meter.measured()
    _write_scalars(writer, "memory_measured", step, MemoryMeter.scalars(memory_measured))
    writer.flush()

    # Every worker builds the copy (gathering split weights is collective); the chief exports.
    plain = _plain_copy(cfg, source, model, par) if cfg.export else None
    export_dir = None if not (cfg.export and role.is_chief) else export_saved_model(
        plain, source, paths.export,
        metadata={"config": cfg.to_dict(), "class_names": list(source.class_names),
                  "input_shape": list(source.image_shape), "pixel_dtype": source.pixel_dtype.name,
                  "metrics": test_metrics, "step": total_steps},
        checkpoint=manager.latest_checkpoint)
    summary = {
        "step": total_steps, "strategy": par.name, "devices": par.devices,
        "model": cfg.model, "dataset": source.name, "global_batch": cfg.batch_size,
        **{k: train_metrics.get(k) for k in ("loss", "accuracy")}, **steady.summary(),
        **test_metrics, "wall_time_s": time.perf_counter() - started, "export_dir": export_dir,
        "memory_per_device_bytes": memory, "memory_measured": memory_measured,
        "skipped_images": len(source.skipped),
    }
    if profiler and profiler.report:
        summary["communication"] = {"mean": profiler.report["mean"], "report": paths.comm_report + ".md",
                                    "moved_bytes_per_device": {k: v["moved_bytes"] for k, v in
                                                               profiler.report["bytes_per_device"].items()}}
    if plan:
        summary["plan"] = with_measurement(plan, summary["step_time_s"])
    role.write_summary(paths, summary)
    role.close()
    return summary


def _check_fits(cfg, memory: dict, par) -> None:
    """Refuses a run whose estimated bytes per device exceed --device_memory_limit.

    Activations grow with the batch, the rest does not, so the message can name the largest
    global batch the estimate allows.
    """
    limit = cfg.device_memory_limit * 2**20
    if limit and not memory:
        raise UsageError("--device_memory_limit needs a memory estimate, which a subclassed model cannot give: "
                         "build the model with the functional API, or drop --device_memory_limit")
    if not limit or memory["total"] <= limit:
        return
    with_batch = memory["activations"] + memory["input"] + memory["transient"]   # grow with the batch
    per_example = with_batch / par.replica_batch
    fits = int((limit - (memory["total"] - with_batch)) // per_example) * par.num_replicas
    hint = (f"use --batch_size<={fits}" if fits >= par.num_replicas
            else "even one example per device does not fit")
    raise DoesNotFit(f"--strategy={par.name} --batch_size={cfg.batch_size} needs about "
                     f"{memory['total'] / 2**20:.0f} MiB per device but "
                     f"--device_memory_limit={cfg.device_memory_limit}: "
                     f"{hint}, or split the model (--strategy=model or hybrid)")


def _profiler(cfg, paths, par, model, start, total_steps):
    """The StepProfiler for --profile_steps (None without it, or when the run is past it)."""
    if not cfg.profile_range:
        return None
    profiler = StepProfiler(cfg.profile_range, paths.tensorboard, paths.comm_report, par, model, meta={
        "strategy": par.name, "devices": par.devices, "mesh": par.mesh_shape,
        "global_batch": cfg.batch_size, "model": cfg.model})
    if profiler.last > total_steps:
        raise UsageError(f"--profile_steps={cfg.profile_steps} goes past the last step ({total_steps}): "
                         f"profile steps up to {total_steps}, or train longer")
    if profiler.first <= start:
        logging.warning("--profile_steps=%s: the run resumes at step %d, past step %d; nothing is profiled",
                        cfg.profile_steps, start, profiler.first)
        return None
    return profiler


def build_model_and_optimizer(cfg: Config, par, source, total_steps: int, **model_kwargs):
    """The model and its optimizer, created in the parallelism's scope from `cfg.seed`.

    Seeding right before building gives the same initial weights under every strategy. With
    --dtype=bfloat16/float16 the layers get Keras' mixed policy (float32 weights, low-precision
    compute); the global policy is restored afterwards, so the exported copy is float32.
    """
    keras.utils.set_random_seed(cfg.seed)
    previous = keras.config.dtype_policy()
    if cfg.dtype != "float32":
        keras.config.set_dtype_policy(f"mixed_{cfg.dtype}")
    try:
        model = par.build_model(lambda: build_model(cfg.model, source.image_shape, source.num_classes, **model_kwargs))
    finally:
        keras.config.set_dtype_policy(previous)
    with par.scope():
        optimizer = MomentumSGD(
            learning_rate_schedule(cfg.learning_rate, cfg.lr_schedule, total_steps, cfg.warmup_steps),
            momentum=cfg.momentum, l2=cfg.weight_decay)
        if cfg.dtype == "float16":   # float16 gradients underflow without loss scaling
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        # Build the slots now, inside the scope, so they are mirrored like their variables.
        optimizer.build(model.trainable_variables)
    # Dropout masks are drawn per step: the step is the optimizer's (checkpointed) count.
    use_step(model, optimizer.iterations)
    return model, optimizer


def _plain_copy(cfg, source, model, par):
    """A fresh single-device model holding the trained values (what we export)."""
    plain = build_model(cfg.model, source.image_shape, source.num_classes)
    plain.set_weights([par.to_numpy(v) for v in model.weights])
    return plain


class Throughput:
    """Examples/s and step time over many logging windows; the first window is warm-up."""

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


def _to_next(step: int, every: int) -> int:
    """Steps from `step` to the next multiple of `every`."""
    return every - step % every


def _write_scalars(writer, prefix, step, values):
    with writer.as_default(step=step):
        for name, value in values.items():
            tf.summary.scalar(f"{prefix}/{name}", value)
