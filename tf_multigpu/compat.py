"""Every private TensorFlow and Keras name the package uses, behind one door.

Each entry says why no public API does the job; `tests/test_compat.py` calls every one, so an
upgrade that moves or renames one fails there, loudly, and the next release touches this file
only. Nothing outside this module imports `keras.src`, `tensorflow.python` or reaches for an
underscore attribute of a TensorFlow or Keras object.
"""

from __future__ import annotations


def keras_name_scope_path() -> str:
    """Keras' current name-scope path (e.g. 'alexnet/conv1') inside a variable creator.

    A `tf.variable_creator_scope` creator is told a variable's name but not its Keras path,
    and layouts are rules on paths; Keras exposes the path only through its private scope stack.
    """
    from keras.src.backend.common.name_scope import current_path
    return current_path()


def inbound_layer_names(layer) -> list[list[str]]:
    """For each call of `layer` in a functional graph, the names of the layers producing its
    inputs, in the order of its inputs (InputLayers included).

    Keras 3 has no public accessor for a layer's inbound nodes (`layer.input` only says the
    tensor, not who made it); the placement plan needs the graph's edges.
    """
    out = []
    for node in layer._inbound_nodes:
        out.append([t._keras_history.operation.name for t in node.input_tensors])
    return out


def op_call_shapes(op) -> tuple:
    """(input shapes, output shape), per example, of the one call of a bare op in a functional
    graph (`x + 3.0` is a `keras.ops` Operation, not a Layer: it has no `input`/`output`).

    Same reason as `inbound_layer_names`: only its private inbound node holds the tensors.
    """
    node = op._inbound_nodes[0]
    return tuple(tuple(t.shape[1:]) for t in node.input_tensors), tuple(node.output_tensors[0].shape[1:])


# keras.ops operations that act on each value alone (keras.src.ops.numpy and .nn class names)
_ELEMENTWISE_OPS = {
    "numpy": ("Add", "Subtract", "Multiply", "Divide", "TrueDivide", "Maximum", "Minimum", "Negative", "Absolute",
              "Square", "Sqrt", "Exp", "Log", "Power", "Clip", "Tanh", "Sign", "Reciprocal"),
    "nn": ("Relu", "Relu6", "Sigmoid", "HardSigmoid", "HardSilu", "Silu", "Gelu", "Elu", "Selu", "LeakyRelu",
           "Softplus", "Softsign"),
}


def elementwise_op(op) -> bool:
    """Whether a bare op of a functional graph acts on each value alone: one of keras.ops'
    elementwise operations (`x + 3.0`, `keras.ops.relu6`), called on tensors and scalars only:
    Python or numpy numbers (`x * np.float32(0.5)`); an array constant would be whole beside a
    channel-split tensor.

    keras.ops are public as functions only; the Operation classes a graph holds, and the
    arguments of their call (its inbound node), are private.
    """
    import numpy as np
    from keras import KerasTensor
    from keras.src.ops import nn, numpy
    classes = tuple(getattr(numpy, n) for n in _ELEMENTWISE_OPS["numpy"]) + tuple(
        getattr(nn, n) for n in _ELEMENTWISE_OPS["nn"])
    if type(op) not in classes:
        return False
    arguments = op._inbound_nodes[0].arguments
    scalar = (int, float, np.number, np.bool_)   # bool is an int, np.float64 a float
    return all(isinstance(a, (KerasTensor, *scalar)) for a in (*arguments.args, *arguments.kwargs.values()))


def per_channel_layers() -> tuple:
    """keras.applications' own layers that scale each channel by a weight of their own
    (ConvNeXt's LayerScale: `x * gamma`, gamma of the channel count), for the placement plan to
    split that weight with the channels.

    keras.applications exports its model functions, not these layers.
    """
    from keras.src.applications.convnext import LayerScale
    return (LayerScale,)


def producer_name(tensor) -> str:
    """The name of the layer (or InputLayer) that produced a symbolic Keras tensor.

    Same reason as `inbound_layer_names`: KerasTensors carry their producer only in the
    private `_keras_history`.
    """
    return tensor._keras_history.operation.name


def producer(tensor):
    """(the operation that produced a symbolic Keras tensor, the node of that call: its
    `input_tensors`), or None for a tensor that has no producer. Same reason as
    `producer_name`; the node is found by the private `_inbound_nodes` too."""
    history = getattr(tensor, "_keras_history", None)
    if history is None:
        return None
    return history.operation, history.operation._inbound_nodes[history.node_index]


# -- Keras optimizers ------------------------------------------------------------------------

def optimizer_variable_index(optimizer, variable) -> int:
    """The index of `variable` in the optimizer's per-variable slot lists (`momentums`, ...).

    Keras' own `update_step`s look their slots up this way; there is no public accessor.
    """
    return optimizer._get_variable_index(variable)


class NamedGradientAllReduce:
    """Optimizer mixin (before the Keras optimizer in the bases): the replicas' gradient
    all-reduce runs inside `tf.name_scope(ALL_REDUCE_SCOPE)`, so profiles can find it.

    Keras' TensorFlow optimizer sums the replicas' gradients in the private hook
    `_all_reduce_sum_gradients` (data parallelism); overriding it is the only way to name it.
    """

    ALL_REDUCE_SCOPE = "allreduce/gradients"

    def _all_reduce_sum_gradients(self, grads_and_vars):
        import tensorflow as tf
        with tf.name_scope(self.ALL_REDUCE_SCOPE):
            return super()._all_reduce_sum_gradients(grads_and_vars)


# -- tf.distribute ---------------------------------------------------------------------------

MIRRORED_KEY_STRIDE = 100_000


def new_mirrored_collective_keys() -> None:
    """Gives the next MirroredStrategy in this process collective keys of its own.

    Every MirroredStrategy numbers its collective groups from the class attribute
    `_collective_key_base`, so a second strategy over another device set in the same process
    (benchmarks, tests) reuses group key 1 for a group of another size and fails: "Device ...
    is joining a group with size4, but that group has size 2 (group_key=1)". TensorFlow's own
    tests shift this base the same way.
    """
    import tensorflow as tf
    tf.distribute.MirroredStrategy._collective_key_base += MIRRORED_KEY_STRIDE


def multi_worker_mirrored_strategy(cluster_resolver, communication_options, num_cpu_devices: int):
    """`tf.distribute.MultiWorkerMirroredStrategy` with `num_cpu_devices` logical CPUs per worker
    (0: the stock strategy's devices, i.e. every GPU).

    The stock strategy takes every GPU of a worker but only ONE device of a worker without
    GPUs (`CollectiveAllReduceExtended`'s local-device hook returns ("CPU", 1)); which devices
    a worker contributes is not configurable through any public argument.
    """
    import tensorflow as tf
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars

    class LogicalCpuExtended(cars.CollectiveAllReduceExtended):
        """The stock implementation, with N logical CPU devices per worker instead of one."""

        def _initialize_local_devices(self, cluster_resolver, worker_device):
            if not num_cpu_devices:
                return super()._initialize_local_devices(cluster_resolver, worker_device)
            return tuple(f"{worker_device}/device:CPU:{i}" for i in range(num_cpu_devices)), "CPU"

    class LogicalCpuMultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
        def __init__(self):
            # What MultiWorkerMirroredStrategy.__init__ does, with our extended class (it only
            # adds usage gauges besides).
            tf.distribute.Strategy.__init__(self, LogicalCpuExtended(
                self, cluster_resolver=cluster_resolver, communication_options=communication_options))

    return LogicalCpuMultiWorkerMirroredStrategy()


def configure_coordination_service(job: str, num_tasks: int, heartbeat_timeout_s: int,
                                   register_timeout_s: int, shutdown_timeout_s: int) -> None:
    """Starts TensorFlow's coordination service for `num_tasks` tasks of `job`, task 0 leading.

    The public `tf.distribute` strategies start it only with TensorFlow's default timeouts
    (and DTensor's `initialize_accelerator_system` likewise); the heartbeat timeout, which
    decides how soon a dead peer becomes an error on the survivors, is set only through the
    eager context.
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=f"/job:{job}/replica:0/task:0",
        heartbeat_timeout_in_ms=heartbeat_timeout_s * 1000,
        cluster_register_timeout_in_ms=register_timeout_s * 1000,
        shutdown_barrier_timeout_in_ms=shutdown_timeout_s * 1000,
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name=job, num_tasks=num_tasks)])


def wait_for_all_tasks(barrier_id: str, timeout_s: int) -> None:
    """Blocks until every task of the coordination service reaches the barrier `barrier_id`
    (the eager context's `wait_at_barrier`; no public API).

    A run's last collective is resolved through task 0 (`CompleteInstance`): a chief that
    exits as soon as its own part is done leaves a slower worker's last collective with no
    one to ask (`UNAVAILABLE: failed to connect ... CompleteInstance`, seen under load)."""
    from tensorflow.python.eager import context
    context.context().wait_at_barrier(barrier_id, timeout_s * 1000)


def gpu_memory_limits() -> list[int]:
    """The memory, in bytes, TensorFlow may allocate on each local GPU (empty without GPUs).

    `tf.config.experimental.get_memory_info` reports use, not capacity; only the private
    `device_lib` lists each device's limit. Listing initialises the devices.
    """
    from tensorflow.python.client import device_lib
    return [d.memory_limit for d in device_lib.list_local_devices() if d.device_type == "GPU"]


def onednn_enabled() -> bool | None:
    """Whether this process runs oneDNN's CPU kernels (None where TensorFlow cannot say).

    TensorFlow decides at start-up, from TF_ENABLE_ONEDNN_OPTS and the CPU (TF 2.21 on x86: on
    by default with AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX, off otherwise; port.cc), and no
    public API reports the outcome; its own test utilities read this flag
    (`test_util.IsMklEnabled`)."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return None


# -- the profiler ----------------------------------------------------------------------------

def profiler_step(step_num: int):
    """A `tf.profiler.experimental.Trace` that marks training step `step_num` in a trace.

    The profiler (and TensorBoard's profile plugin) treats an event as a step only with the
    undocumented `_r=1` argument, as Keras' own TensorBoard callback passes it.
    """
    import tensorflow as tf
    return tf.profiler.experimental.Trace("train", step_num=step_num, _r=1)


def xplane_pb2():
    """The profiler's XSpace protobuf module, which reads the `*.xplane.pb` traces it writes.

    TensorFlow ships it only under `tensorflow.tsl`, outside its public API.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2 as module
    return module


def branch_graphs(op) -> list:
    """The graphs of a traced `tf.cond` or `tf.switch_case` op's branches (If, StatelessIf,
    Case, StatelessCase ops of a tf.function's graph), in the op's order, those that have
    one; [] for other ops.

    TensorFlow keeps each branch as a function in the outer graph's library and has no public
    API from the op to its FuncGraph; `Graph._get_function(name).graph` is the lookup its own
    control-flow gradients use (cond_v2).
    """
    attrs = {"If": ("then_branch", "else_branch"), "StatelessIf": ("then_branch", "else_branch"),
             "Case": ("branches",), "StatelessCase": ("branches",)}.get(op.type, ())
    names = []
    for attr in attrs:
        value = op.get_attr(attr)
        names += [f.name for f in value] if isinstance(value, list) else [value.name]
    functions = [op.graph._get_function(name) for name in names]
    # A branch known only as a FunctionDef (a graph rebuilt from its proto) has no FuncGraph.
    return [f.graph for f in functions if f is not None and getattr(f, "graph", None) is not None]


def all_layers(model) -> list:
    """Every layer of a model, nested models' layers included (not the model itself).

    Keras 3 has no public recursive accessor; `Layer._flatten_layers` is what Keras' own
    summary and weight tracking use.
    """
    return list(model._flatten_layers(include_self=False))


def has_graph(model) -> bool:
    """Whether a model is Sequential or functional (a graph of layers keras.models.clone_model
    and the placement plan can read), not a subclassed keras.Model.

    The functional model's class has no public name (`keras.Model(inputs, outputs)` returns a
    `keras.src.models.functional.Functional`).
    """
    import keras
    from keras.src.models.functional import Functional
    return isinstance(model, (keras.Sequential, Functional))
