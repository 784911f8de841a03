"""`--strategy=single` and `--strategy=data` on tf.distribute.

Data parallelism is MirroredStrategy: every device holds the whole model, takes its share of
the global batch, and the gradients are summed across devices (the Keras optimizer does the
all-reduce in replica context) before the same update is applied everywhere. One device is
OneDeviceStrategy, so both run the very same step and loop code. Across workers
(`parallel/cluster.py`) data parallelism is MultiWorkerMirroredStrategy over every worker's
devices: the same code, with each worker reading only its replicas' rows of every global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import keras
import tensorflow as tf

from tf_multigpu import compat
from tf_multigpu.compat import new_mirrored_collective_keys
from tf_multigpu.parallel.placement import make_plan
from tf_multigpu.parallel.stateless_dropout import replaced as dropout_replaced
from tf_multigpu.parallel.stateless_dropout import stateless_dropout

_SUM = tf.distribute.ReduceOp.SUM


def cross_device_ops(name: str, devices) -> tf.distribute.CrossDeviceOps | None:
    """The all-reduce implementation for --all_reduce (None: TensorFlow's own choice); nccl
    and hierarchical_copy need GPUs (config/plan_checks.py refuses them elsewhere)."""
    if name == "auto":
        return None
    return {
        "nccl": tf.distribute.NcclAllReduce,
        "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
        "one_device": tf.distribute.ReductionToOneDevice,
    }[name]()


def _swapped(layer, batchnorm: str) -> bool:
    """Whether build_model replaces this layer (a stock Dropout or SpatialDropout, or BatchNorm
    to synchronise)."""
    return dropout_replaced(layer) or (
        type(layer) is keras.layers.BatchNormalization and batchnorm == "sync" and not layer.synchronized)


class DistributeParallelism:
    """Runs a single-replica step function on every replica of a tf.distribute strategy."""

    def __init__(self, strategy: tf.distribute.Strategy, devices, global_batch: int, name: str,
                 input_shard: tuple = (0, 1), batchnorm: str = "sync", all_reduce: str = "auto"):
        self.strategy = strategy
        self.all_reduce = all_reduce   # --all_reduce: the communication report reads one_device's copies
        self.batchnorm = batchnorm   # sync: statistics over the global batch; per_replica: over each share
        self.devices = list(devices)
        self.name = name
        self.global_batch = global_batch
        self.num_replicas = strategy.num_replicas_in_sync
        # (i, n): this process reads the i-th of n equal row slices of every global batch.
        self.input_shard = input_shard
        self.spans_workers = input_shard[1] > 1
        self.plan = None   # set by build_model
        self.spmd_lowered = False

    @classmethod
    def create(cls, name: str, devices, global_batch: int, all_reduce: str = "auto", batchnorm: str = "sync"):
        if name == "single":
            return cls(tf.distribute.OneDeviceStrategy(devices[0]), devices[:1], global_batch, name,
                       batchnorm=batchnorm)
        new_mirrored_collective_keys()   # a second strategy in one process needs its own
        strategy = tf.distribute.MirroredStrategy(
            devices=list(devices), cross_device_ops=cross_device_ops(all_reduce, devices))
        return cls(strategy, devices, global_batch, name, batchnorm=batchnorm, all_reduce=all_reduce)

    @classmethod
    def multi_worker(cls, runtime, global_batch: int, batchnorm: str = "sync"):
        """Data parallelism over every device of every worker (the runtime's strategy, whose
        collectives TensorFlow chooses: there is no --all_reduce across workers).

        Worker w holds replicas w*L .. w*L+L-1 and so reads rows [w*B/W, (w+1)*B/W) of each
        global batch: replica i gets rows [i*B/N, (i+1)*B/N), as in one process.
        """
        cluster = runtime.cluster
        return cls(runtime.strategy, runtime.all_devices, global_batch, "data",
                   input_shard=(cluster.task_index, cluster.num_workers), batchnorm=batchnorm)

    def scope(self) -> contextlib.AbstractContextManager:
        """Variables (model, optimizer slots) created here are mirrored on every device."""
        return self.strategy.scope()

    @property
    def mesh_shape(self) -> dict:
        """As a mesh: every replica is a batch group of one device."""
        return {"batch": self.num_replicas, "model": 1}

    def build_model(self, build: Callable):
        """Builds the model with its variables mirrored on every device, its Dropout layers
        drawing the masks one device would (`stateless_dropout`) and, with batchnorm=sync, its
        BatchNormalization layers normalising by the global batch's statistics.

        The swap clones the built model (same initial values); a subclassed model cannot be
        cloned, so it keeps its stock layers, and says so.
        """
        with self.scope():
            model = self._swap_layers(build())
        # A subclassed model has no graph to read: it trains, without a memory estimate.
        self.plan = make_plan(model, "", [], self.mesh_shape) if compat.has_graph(model) \
            else None
        return model

    def _swap_layers(self, plain):
        if not any(_swapped(layer, self.batchnorm) for layer in compat.all_layers(plain)):
            return plain
        if not compat.has_graph(plain):   # clone_model refuses those
            print(f"note: {plain.name} is a subclassed model, so its Dropout/BatchNormalization layers stay "
                  "per-replica (masks and statistics differ from one device's); a functional or Sequential "
                  "model gets replica-independent ones", flush=True)
            return plain
        model = keras.models.clone_model(plain, clone_function=self._clone_layer, recursive=True)
        model.set_weights(plain.get_weights())
        return model

    def _clone_layer(self, layer):
        if type(layer) is keras.layers.BatchNormalization and self.batchnorm == "sync":
            # Keras' TF backend then all-reduces each replica's sums, sums of squares and
            # counts (backend/tensorflow/nn.py: _compute_moments_sync), in the forward and,
            # through the all-reduce's gradient, the backward: one device's statistics over the
            # global batch. Moving averages are then the same on every replica.
            return keras.layers.BatchNormalization.from_config({**layer.get_config(), "synchronized": True})
        return stateless_dropout(layer)

    @property
    def replica_batch(self) -> int:
        return self.global_batch // self.num_replicas

    def distribute(self, make_dataset: Callable[[int], tf.data.Dataset]):
        """A distributed dataset from `make_dataset(batch_size)` giving per-replica batches."""
        return self.strategy.distribute_datasets_from_function(
            lambda context: make_dataset(self.replica_batch))

    def compile(self, replica_fn: Callable[..., dict]) -> Callable:
        """A tf.function `run(iterator, num_steps)`: runs `replica_fn` on every replica for
        `num_steps` batches of the iterator and returns its scalars summed over replicas and
        steps. Several steps per call keep Python off the hot path, as Keras'
        steps_per_execution and Orbit's steps_per_loop do.

        A step that names its float32 scalars (`replica_fn.scalars`, training/step.py) is traced
        once, inside the loop, its totals starting at zero; any other is traced twice, once
        for the first step (which gives the totals' structure) and once for the loop's body.
        Tracing a large model's step costs as much as running it (MobileNetV2 in float64: ~12 s
        a trace)."""

        def one_step(iterator):
            per_replica = self.strategy.run(replica_fn, args=next(iterator))
            return {k: self.strategy.reduce(_SUM, v, axis=None) for k, v in per_replica.items()}

        names = getattr(replica_fn, "scalars", None)

        @tf.function
        def run(iterator, num_steps):
            if names is None:
                totals, num_steps = one_step(iterator), num_steps - 1
            else:
                totals = {k: tf.zeros([], tf.float32) for k in names}
            for _ in tf.range(num_steps):
                totals = {k: v + new for (k, v), new in zip(totals.items(), one_step(iterator).values())}
            return totals

        # One step alone, whose graph holds that step's collectives at its top level (the
        # window's are inside its loop's body): the communication report traces it, once.
        run.one_step = tf.function(one_step)
        return run

    def local_shape(self, variable) -> list:
        """Every device holds the whole variable."""
        return list(variable.shape)

    def relayout_like(self, value, variable):
        """Slots are mirrored like their variables: nothing to move."""
        return value

    def split_dims(self, variable) -> tuple:
        """No variable is split: every device holds all of it."""
        return ()

    def to_numpy(self, variable):
        """The value of a (mirrored) variable, as one array."""
        return variable.numpy()

    def any_worker(self, flag: bool) -> bool:
        """True on every worker if `flag` is true on any (a collective across workers)."""
        if not self.spans_workers:
            return flag
        values = self.strategy.experimental_distribute_values_from_function(
            lambda context: tf.constant(1.0 if flag else 0.0))
        return bool(self.strategy.reduce(_SUM, values, axis=None).numpy() > 0)
