"""Building a run: everything a training step needs, made in one order by `build_run`.

The training loop (`loop.train`), the benchmark worker (tools/bench/worker.py) and the tests
all build their runs here, so they check the same rules and get the same model, seeding,
placement, optimizer and compiled step. Building writes nothing: every rule is checked and
any earlier state restored before the loop writes its first file. A Config with
`run_dir=None` builds a run in memory, which restores nothing and cannot be written.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import os
from collections.abc import Callable

import keras
import tensorflow as tf
from absl import logging

from tf_multigpu.config import Config, RunPaths, check_plan, check_previous_run, load_config
from tf_multigpu.data import ImageSource, load_source
from tf_multigpu.data.pipeline import steps_per_epoch, test_dataset, train_dataset
from tf_multigpu.errors import DoesNotFit, UsageError
from tf_multigpu.models import build_model, get_factory
from tf_multigpu.parallel import Parallelism, make_parallelism
from tf_multigpu.parallel.base import host_scalars
from tf_multigpu.parallel.memory import bytes_per_device, largest_batch
from tf_multigpu.parallel.stateless_dropout import random_layers, use_step
from tf_multigpu.profiling.memory_measured import MemoryMeter
from tf_multigpu.training.optimizer import MomentumSGD, learning_rate_schedule
from tf_multigpu.training.step import make_eval_step, make_train_step
from tf_multigpu.training.workers import WorkerRole


@dataclasses.dataclass
class Run:
    """A built run: what the loop drives, and what `finish_run` exports and reports."""

    cfg: Config
    source: ImageSource
    par: Parallelism
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    checkpoint: tf.train.Checkpoint
    manager: tf.train.CheckpointManager | None   # None: a run in memory
    paths: RunPaths | None                       # None: a run in memory
    role: WorkerRole
    start_step: int            # restored from the latest checkpoint (0: a new run)
    total_steps: int
    steps_per_epoch: int
    train_fn: Callable         # (iterator, num_steps) -> the step's scalars summed over the steps
    eval_fn: Callable          # (iterator, num_batches) -> the eval step's scalars, summed
    memory: dict               # estimated bytes per device ({}: a subclassed model has no graph to read)
    meter: MemoryMeter         # started before the model was built: the measured peaks' baseline

    def train_batches(self):
        """An iterator over the run's global batches from its start step, distributed."""
        return iter(self.par.distribute(lambda b: self._train_dataset(b)))

    def local_batches(self) -> tf.data.Dataset:
        """This process's rows of each global batch from the start step, undistributed (what the
        input pipeline must keep up with, data/throughput.py)."""
        return self._train_dataset(self.cfg.batch_size // self.par.input_shard[1])

    def evaluate(self) -> dict:
        """Loss and accuracy over the whole test split."""
        batches = math.ceil(self.source.num_test / self.cfg.batch_size)
        sums = host_scalars(self.eval_fn(iter(self._test_data), tf.constant(batches)))
        return {"test_loss": sums["loss_sum"] / sums["count"], "test_accuracy": sums["correct"] / sums["count"]}

    def banner(self) -> str:
        """One line saying what runs where."""
        per_device = (f"{self.memory['parameters'] / 2**20:.1f} MiB parameters, "
                      f"{self.memory['total'] / 2**20:.1f} MiB in all" if self.memory
                      else "no memory estimate (subclassed model)")
        return (f"{self.par.name} parallelism on {len(self.par.devices)} device(s): {', '.join(self.par.devices)}; "
                f"{self.source.name} {self.source.image_shape}, {self.cfg.model} "
                f"({self.model.count_params():,} parameters), global batch {self.cfg.batch_size}, "
                f"steps {self.start_step}..{self.total_steps}; per device: {per_device}")

    def _train_dataset(self, batch_size: int) -> tf.data.Dataset:
        return train_dataset(self.source, seed=self.cfg.seed, global_batch=self.cfg.batch_size,
                             batch_size=batch_size, start_step=self.start_step, shard=self.par.input_shard)

    @functools.cached_property
    def _test_data(self):
        return self.par.distribute(lambda b: test_dataset(self.source, global_batch=self.cfg.batch_size,
                                                          batch_size=b, shard=self.par.input_shard))


def build_run(cfg: Config, devices: list[str], runtime=None, *, source: ImageSource | None = None) -> Run:
    """The run `cfg` describes on `devices` (or, given a started multi-worker `runtime`, on
    every worker's), restored from its run directory's latest checkpoint.

    `cfg.strategy` is resolved (not auto: the entry point asks the planner). `source` is the
    data set if the caller loaded it already (default: `load_run_source(cfg)`). Raises
    UsageError (DoesNotFit) for anything the user must fix, before anything is written.
    """
    check_plan(cfg, runtime.all_devices if runtime else devices, runtime.cluster if runtime else None)
    get_factory(cfg.model)   # an unknown model is reported before anything is built
    source = load_run_source(cfg) if source is None else source
    par = make_parallelism(cfg.strategy, devices, cfg.batch_size, cfg.all_reduce, cfg.mesh_shape,
                           cfg.layout, cfg.layout_rule_list, runtime=runtime, batchnorm=cfg.batchnorm,
                           shard_optimizer_state=cfg.shard_optimizer_state, layout_overrides=cfg.layout_override_list)
    role = WorkerRole(runtime, shared_checkpoints=cfg.strategy in ("model", "hybrid"))
    per_epoch = steps_per_epoch(source, cfg.batch_size)
    paths = check_previous_run(cfg) if cfg.run_dir else None
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
    manager = role.checkpoint_manager(checkpoint, paths) if paths else None
    if cfg.profile_range and cfg.profile_range[1] > total_steps:
        raise UsageError(f"--profile_steps={cfg.profile_steps} goes past the last step ({total_steps}): "
                         f"profile steps up to {total_steps}, or train longer")
    start_step = int(optimizer.iterations.numpy())
    if paths and start_step:
        check_resumed_length(cfg, paths, start_step, total_steps, per_epoch)
    memory = bytes_per_device(par.plan, cfg.batch_size, slots_per_parameter=1 if cfg.momentum else 0) \
        if par.plan else {}   # a subclassed model (data parallel) has no graph to estimate from
    check_fits(cfg, memory, par)
    return Run(cfg, source, par, model, optimizer, checkpoint, manager, paths, role,
               start_step=start_step, total_steps=total_steps, steps_per_epoch=per_epoch,
               train_fn=par.compile(make_train_step(model, optimizer, cfg.batch_size, jit_compile=cfg.xla)),
               eval_fn=par.compile(make_eval_step(model)), memory=memory, meter=meter)


def check_resumed_length(cfg: Config, paths: RunPaths, start_step: int, total_steps: int, per_epoch: int) -> None:
    """Refuses a length that ends before the restored step (the run would rewrite config.json
    and summary.json for a step its checkpoints are past); warns when a schedule that spans
    the run changes its span on resume (the steps done followed the old one)."""
    length = f"--steps={cfg.steps}" if cfg.steps is not None else f"--epochs={cfg.epochs} ({total_steps} steps)"
    if start_step > total_steps:
        raise UsageError(f"--run_dir={cfg.run_dir} is at step {start_step}, past the end of {length}: pass "
                         f"--steps={start_step} or more to go on from it, or use a new --run_dir")
    if cfg.lr_schedule == "constant" or not os.path.exists(paths.config):
        return
    previous = load_config(paths.config)
    before = previous.steps if previous.steps is not None else math.ceil(previous.epochs * per_epoch)
    if before != total_steps:
        logging.warning("%s: the %s learning-rate schedule now spans %d steps instead of %d; steps 1-%d "
                        "followed the old span, so this run differs from one trained for %d steps from the "
                        "start", length, cfg.lr_schedule, total_steps, before, start_step, total_steps)


def load_run_source(cfg: Config) -> ImageSource:
    """The data set `cfg` names, as a run reads it."""
    return load_source(cfg.dataset, cfg.data_dir, cfg.image_size, augment=cfg.augment,
                       test_fraction=cfg.test_fraction, skip_bad_images=cfg.skip_bad_images,
                       input_threads=cfg.input_threads)


def check_fits(cfg: Config, memory: dict, par) -> None:
    """Refuses a run whose estimated bytes per device exceed --device_memory_limit, naming
    the largest global batch the same estimate allows."""
    limit = cfg.device_memory_limit * 2**20
    if limit and not memory:
        raise UsageError("--device_memory_limit needs a memory estimate, which a subclassed model cannot give: "
                         "build the model with the functional API, or drop --device_memory_limit")
    if not limit or memory["total"] <= limit:
        return
    fits = largest_batch(par.plan, limit, par.num_replicas, slots_per_parameter=1 if cfg.momentum else 0)
    hint = f"use --batch_size<={fits}" if fits else "even one example per device does not fit"
    raise DoesNotFit(f"--strategy={par.name} --batch_size={cfg.batch_size} needs about "
                     f"{memory['total'] / 2**20:.0f} MiB per device but "
                     f"--device_memory_limit={cfg.device_memory_limit}: "
                     f"{hint}, or split the model (--strategy=model or hybrid)")


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
    # Every parallelism builds the user's model and then a clone (split-aware or replica-
    # independent layers); the first copy is garbage in reference cycles (Keras layers and their
    # trackers), which only a full collection frees. Left alone, its weights (AlexNet: 233 MiB)
    # were held through training: TensorFlow's allocator held them after the build on one device
    # and on every mesh alike.
    gc.collect()
    with par.scope():
        optimizer = MomentumSGD(
            learning_rate_schedule(cfg.learning_rate, cfg.lr_schedule, total_steps, cfg.warmup_steps),
            momentum=cfg.momentum, l2=cfg.weight_decay, relayout_like=par.relayout_like,
            split_dims=par.split_dims)
        if cfg.dtype == "float16":   # float16 gradients underflow without loss scaling
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        # Build the slots now, inside the scope, so they are mirrored like their variables.
        optimizer.build(model.trainable_variables)
    # Dropout masks are drawn per step: the step is the optimizer's (checkpointed) count.
    use_step(model, optimizer.iterations)
    drawing = random_layers(model)
    if drawing and len(par.devices) > 1:
        print(f"note: {', '.join(drawing)} draw their own random numbers on each device: a valid noise, but "
              "not one device's (Dropout and SpatialDropout layers are made device-independent)", flush=True)
    return model, optimizer
