"""Every private TensorFlow/Keras name of tf_multigpu/compat.py, called or checked here, so an
upgrade that moves one fails in this file (with the name in the failure), not somewhere deep in
a training run; and a scan proving no private name is used anywhere else."""

import ast
import inspect
import os

import keras
import numpy as np
import tensorflow as tf

from tests.conftest import DEVICES, REPO
from tf_multigpu import compat
from tf_multigpu.training.optimizer import MomentumSGD


def test_keras_name_scope_path_is_the_keras_path_inside_a_variable_creator():
    seen = []

    def creator(next_creator, **kwargs):
        seen.append(compat.keras_name_scope_path())
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="head")], name="net")
    assert seen and all(path.endswith("head") for path in seen), seen


def test_inbound_layer_names_and_producer_name_read_the_functional_graph():
    x = keras.Input((4,), name="pixels")
    a = keras.layers.Dense(3, name="a")(x)
    b = keras.layers.Dense(3, name="b")(x)
    out = keras.layers.Add(name="sum")([a, b])
    model = keras.Model(x, out)
    assert compat.inbound_layer_names(model.get_layer("sum")) == [["a", "b"]]
    assert compat.inbound_layer_names(model.get_layer("a")) == [["pixels"]]
    assert compat.producer_name(out) == "sum" and compat.producer_name(x) == "pixels"
    operation, node = compat.producer(out)
    assert operation.name == "sum" and [t is a or t is b for t in node.input_tensors] == [True, True]
    assert compat.producer(keras.ops.ones((2,))) is None   # a concrete tensor


def test_elementwise_op_tells_keras_ops_that_act_on_each_value_alone():
    x = keras.Input((4, 4, 8))

    def bare(y):
        return [op for op in keras.Model(x, y).operations if not isinstance(op, keras.layers.Layer)]

    hard_swish = bare(x * keras.ops.relu6(x + 3.0) * (1 / 6))
    assert [type(op).__name__ for op in hard_swish] == ["Add", "Relu6", "Multiply", "Multiply"]
    assert all(compat.elementwise_op(op) for op in hard_swish)
    assert not any(compat.elementwise_op(op) for op in bare(keras.ops.reshape(x, (-1, 4, 32))))   # mixes channels
    assert not any(compat.elementwise_op(op) for op in bare(x * np.arange(8.0)))   # an array constant


def test_per_channel_layers_are_keras_applications_layer_scale():
    (layer_scale,) = compat.per_channel_layers()
    layer = layer_scale(0.5, 8)
    layer(keras.Input((4, 4, 8)))
    assert type(keras.applications.ConvNeXtTiny(weights=None, input_shape=(32, 32, 3)).get_layer(
        "convnext_tiny_stage_0_block_0_layer_scale")) is layer_scale
    assert [tuple(w.shape) for w in layer.weights] == [(8,)]


def test_optimizer_variable_index_finds_each_variables_slot():
    variables = [keras.Variable(np.zeros((2, 3), "float32")), keras.Variable(np.zeros((5,), "float32"))]
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build(variables)
    for i, v in enumerate(variables):
        assert compat.optimizer_variable_index(opt, v) == i
        assert tuple(opt.momentums[i].shape) == tuple(v.shape)


def test_named_gradient_all_reduce_overrides_a_hook_keras_still_calls():
    # If Keras renames the hook, the mixin would silently never run: assert both that the hook
    # exists on Keras' optimizer and that our scope appears in a data-parallel step's graph.
    assert callable(getattr(keras.optimizers.SGD, "_all_reduce_sum_gradients", None)), \
        "Keras' optimizer no longer has _all_reduce_sum_gradients: update compat.NamedGradientAllReduce"
    compat.new_mirrored_collective_keys()
    strategy = tf.distribute.MirroredStrategy(DEVICES[:2])
    with strategy.scope():
        w = keras.Variable(np.ones((3,), "float32"))
        opt = MomentumSGD(0.1)
        opt.build([w])

    @tf.function
    def step():
        strategy.run(lambda: opt.apply([tf.ones((3,))], [w]))

    graph = step.get_concrete_function().graph
    names = [op.name for op in graph.get_operations()]
    for fn in graph._functions.values() if hasattr(graph, "_functions") else []:
        names += [op.name for op in fn.graph.get_operations()] if hasattr(fn, "graph") else []
    assert any(compat.NamedGradientAllReduce.ALL_REDUCE_SCOPE in n for n in names), names[:40]
    step()
    np.testing.assert_allclose(w.numpy(), 1 - 0.1 * 2)   # two replicas' gradients summed


def test_mirrored_collective_key_base_is_an_integer_we_can_shift():
    before = tf.distribute.MirroredStrategy._collective_key_base
    assert isinstance(before, int)
    compat.new_mirrored_collective_keys()
    assert tf.distribute.MirroredStrategy._collective_key_base == before + compat.MIRRORED_KEY_STRIDE


def test_multi_worker_strategy_takes_n_logical_cpus_per_worker():
    # With an empty cluster the strategy runs locally, through the same local-device hook.
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec({}))
    strategy = compat.multi_worker_mirrored_strategy(
        resolver, tf.distribute.experimental.CommunicationOptions(), num_cpu_devices=3)
    assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    assert strategy.num_replicas_in_sync == 3
    assert [d.split("/")[-1] for d in strategy.extended.worker_devices] == ["device:CPU:0", "device:CPU:1",
                                                                            "device:CPU:2"]


def test_coordination_service_entry_points_exist_with_our_arguments():
    # Configuring the service needs a fresh process of a real cluster (tests/test_multiworker.py);
    # here: the names and keyword arguments compat passes still exist.
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context
    params = inspect.signature(context.context().configure_coordination_service).parameters
    for name in ("service_type", "service_leader", "heartbeat_timeout_in_ms", "cluster_register_timeout_in_ms",
                 "shutdown_barrier_timeout_in_ms", "coordinated_jobs"):
        assert name in params, f"configure_coordination_service lost {name}: update compat"
    job = coordination_config_pb2.CoordinatedJob(name="worker", num_tasks=2)
    assert (job.name, job.num_tasks) == ("worker", 2)
    barrier = inspect.signature(context.context().wait_at_barrier).parameters   # compat.wait_for_all_tasks
    assert list(barrier)[:2] == ["barrier_id", "timeout_in_ms"], f"wait_at_barrier: {list(barrier)}; update compat"


def test_profiler_step_marks_a_step_the_xspace_reader_finds(tmp_path):
    tf.profiler.experimental.start(str(tmp_path))
    try:
        with compat.profiler_step(7):
            tf.reduce_sum(tf.ones((4, 4))).numpy()
    finally:
        tf.profiler.experimental.stop()
    from tf_multigpu.profiling import xspace
    steps = xspace.step_times(xspace.latest_trace(str(tmp_path)))
    assert [s["step"] for s in steps] == [7], steps


def test_branch_graphs_are_a_conds_branches_in_order():
    @tf.function
    def step(x):
        return tf.cond(x > 0, lambda: tf.sqrt(x), lambda: tf.square(x))

    graph = step.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
    conds = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
    assert len(conds) == 1
    then_graph, else_graph = compat.branch_graphs(conds[0])
    assert "Sqrt" in {op.type for op in then_graph.get_operations()}
    assert "Square" in {op.type for op in else_graph.get_operations()}
    assert compat.branch_graphs(graph.get_operations()[0]) == []   # the placeholder


def test_onednn_enabled_reads_what_tensorflow_decided():
    """A bool, never None on TensorFlow 2.21 (a build that moved the flag would say None), and
    the decision a fresh process makes from TF_ENABLE_ONEDNN_OPTS (memory_measured's
    cpu_kernels test checks both settings)."""
    assert compat.onednn_enabled() in (True, False)


def test_gpu_memory_limits_lists_no_gpu_on_this_cpu_only_machine():
    assert compat.gpu_memory_limits() == [] or tf.config.list_physical_devices("GPU")


# -- no private name outside compat.py -------------------------------------------------------

_PRIVATE_MODULES = ("tensorflow.python", "tensorflow.compiler", "tensorflow.core", "tensorflow.tsl", "keras.src")
# Private members of Keras' graph objects, reached from a layer or tensor variable (which the
# alias rule cannot see), or by name through getattr.
_KERAS_GRAPH_PRIVATES = ("_keras_history", "_inbound_nodes", "_outbound_nodes", "_keras_mask")


def _sources():
    for top in ("tf_multigpu", "tools", "tests"):
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, REPO), open(path).read()


def _tf_aliases(tree) -> set:
    """Names bound in a module to TensorFlow or Keras modules/objects (tf, keras, ops, ...)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names
                    if a.name.split(".")[0] in ("tensorflow", "keras")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("tensorflow", "keras"):
            out |= {a.asname or a.name for a in node.names}
    return out


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def private_uses(path: str, text: str) -> list:
    """Private TensorFlow/Keras uses in one file: a private module named anywhere (code or
    docs), an underscore attribute reached from a TensorFlow/Keras name, a call of
    `super()._hook`, an `_argument=` to a TensorFlow/Keras call, or a `_method` defined in a class
    that derives from TensorFlow/Keras and
    overrides or reads (`self._x`) a private member the TensorFlow/Keras base defines."""
    found = [f"{path}: mentions {m}" for m in _PRIVATE_MODULES if m in text]
    tree = ast.parse(text)
    aliases = _tf_aliases(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in _KERAS_GRAPH_PRIVATES) or (
                isinstance(node, ast.Constant) and node.value in _KERAS_GRAPH_PRIVATES):
            found.append(f"{path}:{node.lineno}: Keras' {getattr(node, 'attr', None) or node.value}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = _root(node.value)
            if isinstance(root, ast.Name) and root.id in aliases:
                found.append(f"{path}:{node.lineno}: {root.id}...{node.attr}")
            if isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) \
                    and node.value.func.id == "super":
                found.append(f"{path}:{node.lineno}: super().{node.attr}")
        if isinstance(node, ast.Call) and isinstance(_root(node.func), ast.Name) and _root(node.func).id in aliases:
            found += [f"{path}:{node.lineno}: argument {k.arg}=" for k in node.keywords
                      if k.arg and k.arg.startswith("_")]
        if isinstance(node, ast.ClassDef):
            bases = _tf_bases(tree, node, aliases)
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name.startswith("_") \
                        and not item.name.startswith("__") and any(hasattr(b, item.name) for b in bases):
                    found.append(f"{path}:{item.lineno}: {node.name}.{item.name} overrides a private hook")
            for sub in ast.walk(node) if bases else ():
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                        and sub.attr.startswith("_") and not sub.attr.startswith("__") \
                        and any(hasattr(b, sub.attr) for b in bases):
                    found.append(f"{path}:{sub.lineno}: self.{sub.attr} of a TF/Keras base")
    return found


def _tf_bases(tree, cls: ast.ClassDef, aliases: set) -> list:
    """The TensorFlow/Keras classes among `cls`'s bases, evaluated after the module's own
    TensorFlow/Keras imports, wherever they are (only those run)."""
    bases = [b for b in cls.bases if isinstance(_root(b), ast.Name) and _root(b).id in aliases]
    if not bases:
        return []
    namespace = {}
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
               and ((n.module if isinstance(n, ast.ImportFrom) else n.names[0].name) or "").split(".")[0]
               in ("tensorflow", "keras")]
    exec(compile(ast.Module(body=imports, type_ignores=[]), "<imports>", "exec"), namespace)
    return [eval(compile(ast.Expression(b), "<base>", "eval"), namespace) for b in bases]


def test_the_scan_catches_each_kind_of_private_use():
    assert private_uses("x.py", "from tensorflow.python.client import device_lib\n")
    assert private_uses("x.py", "def f(layer, t):\n    return layer._inbound_nodes, getattr(t, '_keras_history')\n")
    assert private_uses("x.py", "import tensorflow as tf\ntf.distribute.MirroredStrategy._collective_key_base += 1\n")
    assert private_uses("x.py", "import tensorflow as tf\ntf.profiler.experimental.Trace('t', _r=1)\n")
    assert private_uses("x.py", "import keras\nclass O(keras.optimizers.SGD):\n    def _hook(self):\n"
                                "        return super()._hook()\n")
    assert private_uses("x.py", "import keras\nclass O(keras.optimizers.SGD):\n    def update_step(self, g, v, lr):\n"
                                "        return self._get_variable_index(v)\n")
    assert not private_uses("x.py", "import keras\nclass L(keras.layers.Layer):\n    def call(self, x):\n"
                                    "        return self._own(x)\n")


def test_no_private_tensorflow_or_keras_name_outside_compat():
    found = []
    for path, text in _sources():
        if path in (os.path.join("tf_multigpu", "compat.py"), os.path.join("tests", "test_compat.py")):
            continue
        found += private_uses(path, text)
    assert not found, "move these into tf_multigpu/compat.py:\n" + "\n".join(found)
