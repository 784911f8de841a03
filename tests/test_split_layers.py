"""Layers on channel-split activations (split_layers, windows) equal the stock Keras layer on one
device: forward output, input gradient, weight gradients (and BatchNorm's moving statistics),
on 1x2 and 2x2 DTensor meshes, with the variables laid out by the class's VARIABLE_SPECS. The
output must keep its expected layout, and on 1x2 (where any collective is a `model` one) the
profiler must see exactly the collectives the layer is documented to run."""

import json
import re
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from tests.launcher import run_code
from tf_multigpu import compat
from tf_multigpu.errors import UsageError
from tf_multigpu.parallel import split_layers as M
from tf_multigpu.parallel import windows as W
from tf_multigpu.parallel.placement import ELEMENTWISE
from tf_multigpu.profiling import xspace

pytestmark = pytest.mark.in_process_mesh   # its tests build DTensor meshes in this process
U = dtensor.UNSHARDED
SPLIT4, WHOLE4 = ["batch", U, U, "model"], ["batch", U, U, U]
MESHES = [(1, 2), (2, 2)]
TOL = 1e-5   # max |got - want| relative to max |want|


def _mesh(devices, b, m):
    return dtensor.create_mesh([("batch", b), ("model", m)], devices=[d.split("device:")[-1] for d in devices[:b * m]])


def _put(mesh, value, specs):
    value = tf.convert_to_tensor(value)
    replicated = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(mesh, value.shape.rank))
    return dtensor.relayout(replicated, dtensor.Layout(specs, mesh))


def _full(mesh, t):
    return dtensor.unpack(dtensor.relayout(t, dtensor.Layout.replicated(mesh, t.shape.rank)))[0].numpy()


def _specs(spec: str, rank: int):
    return [U if a == "-" else a for a in spec.split(",")] if spec else [U] * rank


def _layer(make, shapes, weights, mesh=None, variable_specs=None):
    """make() built for `shapes` with `weights`; on a mesh its variables are DVariables laid
    out by variable_specs (what the placement plan will do with VARIABLE_SPECS)."""
    shape = shapes if len(shapes) > 1 else shapes[0]
    if mesh is None:
        layer = make()
        layer.build(shape)
        layer.set_weights(weights)
        return layer

    def creator(next_creator, **kwargs):
        init = kwargs["initial_value"]
        init = tf.convert_to_tensor(init() if callable(init) else init, dtype=kwargs.get("dtype"))
        layout = _specs((variable_specs or {}).get(kwargs["name"], ""), init.shape.rank)
        return dtensor.DVariable(_put(mesh, init, layout), trainable=kwargs.get("trainable", True),
                                 name=kwargs["name"])

    with tf.variable_creator_scope(creator):
        layer = make()
        layer.mesh = mesh
        layer.build(shape)
    for var, value in zip(layer.weights, weights):
        var.assign(_put(mesh, value, dtensor.fetch_layout(var.value.read_value()).sharding_specs))
    return layer


def _step_fn(layer, training):
    @tf.function
    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            args = list(xs) if len(xs) > 1 else xs[0]
            y = layer(args, training=training) if training is not None else layer(args)
            loss = tf.reduce_sum(y * tf.sin(y))   # a non-trivial upstream gradient
        dxs, dws = tape.gradient(loss, [list(xs), [v.value for v in layer.trainable_weights]])
        return y, dxs, dws
    return step


RUNS = 5   # profiled runs of the step per trace


def _collectives(fn, *args, copies: int = 1) -> tuple[list, bool]:
    """(the collectives the profiler sees fn run (traced before): names of their op events;
    whether the trace saw every run of the step: a `Sin` event, the step's loss op, per run on
    each of the `copies` devices that run it).

    A mesh's devices run a step asynchronously: fn returns while they still compute, so the
    profiler, stopped then, missed the last runs' ops (traces of the grouped convolutions
    held 3 to 7 of the 10 Sin events of 5 runs on 1x2); hence the waits. fn runs RUNS times,
    and a collective counts if any of its events is seen: the CollectiveReduceV2 op itself,
    the executor's `Collective...` events, or the ops DTensor names after it
    (`DTensorAllGatherOp` ...: the pad/slice around an all-gather). "No collective" means
    something only in a trace that saw each run's loss op on every device.
    """
    fn(*args)
    tf.test.experimental.sync_devices()   # its ops, still running, would count as the trace's
    logdir = tempfile.mkdtemp()
    tf.profiler.experimental.start(logdir)
    for _ in range(RUNS):
        fn(*args)
    tf.test.experimental.sync_devices()   # a mesh's devices run asynchronously: wait for the last run
    tf.profiler.experimental.stop()
    space = compat.xplane_pb2().XSpace()
    with open(xspace.latest_trace(logdir), "rb") as f:
        space.ParseFromString(f.read())
    events = [plane.event_metadata[e.metadata_id].name for plane in space.planes for line in plane.lines
              for e in line.events]
    collectives = sorted({name for name in events if "Collective" in name or re.search(r"DTensor\w+Op", name)})
    # An op's event is named "name:Type"; on a mesh each device runs its own Sin, once per run.
    return collectives, sum(name.endswith(":Sin") for name in events) >= RUNS * copies


def _close(got, want, what):
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err < TOL, f"{what}: max error {err:.2e} relative to max |ref|"


def check_parity(devices, stock, split, inputs, in_specs, b, m, out_specs, variable_specs=None,
                 training=None, communicates=False):
    """split (on a b x m mesh, inputs laid out by in_specs) equals stock (one device); on a
    1 x m mesh, returns the names of the collectives it runs (some iff `communicates`)."""
    rs = np.random.RandomState(1)
    probe = stock()
    probe.build([x.shape for x in inputs] if len(inputs) > 1 else inputs[0].shape)
    weights = [rs.uniform(0.5, 1.5, w.shape).astype(np.float32) for w in probe.get_weights()]
    want_layer = _layer(stock, [x.shape for x in inputs], weights)
    want = _step_fn(want_layer, training)(*[tf.constant(x) for x in inputs])

    mesh = _mesh(devices, b, m)
    got_layer = _layer(split, [x.shape for x in inputs], weights, mesh, variable_specs)
    step = _step_fn(got_layer, training)
    xs = [_put(mesh, x, s) for x, s in zip(inputs, in_specs)]
    y, dxs, dws = step(*xs)
    assert dtensor.fetch_layout(y).sharding_specs == out_specs, "output relaid out (a silent gather?)"
    if hasattr(got_layer, "SPLITS_OUTPUT"):   # what the class tells the placement plan
        assert got_layer.SPLITS_OUTPUT == (out_specs[-1] == "model")
    _close(_full(mesh, y), want[0].numpy(), "output")
    for i, (g, w) in enumerate(zip(dxs, want[1])):
        assert dtensor.fetch_layout(g).sharding_specs == in_specs[i], f"input {i} gradient relaid out"
        _close(_full(mesh, g), w.numpy(), f"input {i} gradient")
    for var, g, w in zip(got_layer.trainable_weights, dws, want[2]):
        assert dtensor.fetch_layout(g).sharding_specs == _specs((variable_specs or {}).get(var.name, ""), g.shape.rank)
        _close(_full(mesh, g), w.numpy(), f"{var.name} gradient")
    for var, ref in zip(got_layer.weights, want_layer.weights):   # e.g. BatchNorm's moving statistics
        _close(_full(mesh, var.value.read_value()), ref.numpy(), f"{var.name} after the step")
    if b == 1:
        seen, step_traced = _collectives(step, *xs, copies=m)
        assert step_traced, "the profiler's trace missed runs of the step: no trace to check"
        assert bool(seen) == communicates, f"collectives over `model`: {seen or 'none'}"
        return seen
    return None


def _x(shape=(4, 9, 9, 8), seed=0):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


# -- a) BatchNormalization: stock Keras, variables split with the channels -------------------
@pytest.mark.parametrize("b,m", MESHES)
@pytest.mark.parametrize("training,synchronized", [(True, False), (False, False), (True, True)])
def test_batchnorm_on_split_channels_equals_one_device(devices, b, m, training, synchronized):
    """Training mode: statistics over the GLOBAL batch (a 2x2 mesh holds half the batch per
    device, so per-replica statistics would differ), moving averages updated as on one device,
    no `model` traffic; inference mode uses the moving statistics. `synchronized=True` (what
    data parallelism may set) changes nothing on a mesh."""
    def bn():
        return keras.layers.BatchNormalization(momentum=0.9, synchronized=synchronized, name="bn")
    specs = M.STOCK_VARIABLE_SPECS[keras.layers.BatchNormalization]
    check_parity(devices, bn, bn, [_x()], [SPLIT4], b, m, SPLIT4, specs, training=training)


# -- b) elementwise / pass-through: stock Keras works unchanged ------------------------------
PASS_THROUGH = {
    "relu": (lambda: keras.layers.ReLU(), SPLIT4),
    "relu6": (lambda: keras.layers.ReLU(6.0), SPLIT4),
    "activation_swish": (lambda: keras.layers.Activation("swish"), SPLIT4),
    "rescaling": (lambda: keras.layers.Rescaling(1 / 127.5, offset=-1.0), SPLIT4),
    "zero_padding": (lambda: keras.layers.ZeroPadding2D(((0, 1), (0, 1))), SPLIT4),
    "global_avg_pool": (lambda: keras.layers.GlobalAveragePooling2D(), ["batch", "model"]),
    "global_avg_pool_keepdims": (lambda: keras.layers.GlobalAveragePooling2D(keepdims=True), SPLIT4),
    "global_max_pool": (lambda: keras.layers.GlobalMaxPooling2D(), ["batch", "model"]),
    "dropout_rate_0": (lambda: keras.layers.Dropout(0.0), SPLIT4),
    "leaky_relu": (lambda: keras.layers.LeakyReLU(0.2), SPLIT4),
    "elu": (lambda: keras.layers.ELU(), SPLIT4),
    "cropping": (lambda: keras.layers.Cropping2D(((1, 0), (0, 2))), SPLIT4),
    "identity": (lambda: keras.layers.Identity(), SPLIT4),
    "spatial_dropout_rate_0": (lambda: keras.layers.SpatialDropout2D(0.0), SPLIT4),
}
# What the placement plan passes a channel split through untouched (placement.ELEMENTWISE),
# checked above but for BatchNormalization (its own tests) and the layers that draw noise
# (with rate > 0 per device; training names them in a note).
_NOT_HERE = (keras.layers.BatchNormalization, keras.layers.GaussianNoise, keras.layers.GaussianDropout)


def test_every_layer_the_plan_passes_a_split_through_is_checked():
    checked = {type(make()) for make, _ in PASS_THROUGH.values()}
    assert set(ELEMENTWISE) - set(_NOT_HERE) <= checked, set(ELEMENTWISE) - set(_NOT_HERE) - checked


@pytest.mark.parametrize("b,m", MESHES)
@pytest.mark.parametrize("name", PASS_THROUGH)
def test_stock_pass_through_layers_keep_channels_split(devices, name, b, m):
    make, out_specs = PASS_THROUGH[name]
    assert isinstance(make(), ELEMENTWISE)
    check_parity(devices, make, make, [_x()], [SPLIT4], b, m, out_specs, training=True)


@pytest.mark.parametrize("b,m", MESHES)
def test_dropout_on_split_channels_draws_a_valid_mask_per_shard(devices, b, m):
    """Dropout(0.5) keeps the split and is a valid dropout (kept values scaled by 2, the input
    gradient uses the same mask, independent masks on the two channel halves); its masks are
    NOT one device's (issue 13 item 4 draws them from the global example index)."""
    mesh = _mesh(devices, b, m)
    layer = keras.layers.Dropout(0.5, seed=1)
    x = np.abs(_x((8, 8, 8, 8))) + 0.1
    y, (dx,), _ = _step_fn(layer, True)(_put(mesh, x, SPLIT4))
    assert dtensor.fetch_layout(y).sharding_specs == SPLIT4
    y, dx = _full(mesh, y), _full(mesh, dx)
    kept = y != 0
    np.testing.assert_allclose(y[kept], 2 * x[kept], rtol=1e-6)
    np.testing.assert_allclose(dx[~kept], 0)
    assert 0.4 < kept.mean() < 0.6
    assert (kept[..., :4] == kept[..., 4:]).mean() < 0.7   # not one mask repeated per shard


# -- c) AveragePooling2D -----------------------------------------------------------------
AVG_POOL = {
    "2x2_valid": {"pool_size": 2},   # tiling windows on the 9x9 map: the last row/column is not read
    "3x3_s3_valid": {"pool_size": 3},   # tiling windows, 9 -> 3
    "3x3_s2_valid": {"pool_size": 3, "strides": 2},   # overlapping windows
    "3x3_s2_same_odd": {"pool_size": 3, "strides": 2, "padding": "same"},   # edge windows count 4 or 6 cells
    "2x3_s1_same": {"pool_size": (2, 3), "strides": 1, "padding": "same"},
}


@pytest.mark.parametrize("b,m", MESHES)
@pytest.mark.parametrize("name", AVG_POOL)
def test_slice_avg_pool_equals_keras(devices, name, b, m):
    kw = AVG_POOL[name]
    check_parity(devices, lambda: keras.layers.AveragePooling2D(**kw), lambda: M.SliceAvgPool2D(**kw),
                 [_x()], [SPLIT4], b, m, SPLIT4)


MAX_POOL = {**AVG_POOL, "3x3_s2_valid_55": {"pool_size": 3, "strides": 2}}   # AlexNet's pools


def _with_ties(shape, seed=0):
    """ReLU'd values on a coarse grid: windows with several equal maxima (zeros among them),
    where the gradient must go to the first one, as MaxPoolGrad sends it."""
    return np.round(np.maximum(_x(shape, seed), 0) * 4) / 4


@pytest.mark.parametrize("b,m", MESHES)
@pytest.mark.parametrize("name", MAX_POOL)
def test_slice_max_pool_equals_keras_ties_included(devices, name, b, m):
    from tf_multigpu.parallel.split_layers import SlicePool2D
    kw = MAX_POOL[name]
    x = _with_ties((2, 13, 13, 4) if name.endswith("_55") else (4, 9, 9, 8))
    check_parity(devices, lambda: keras.layers.MaxPooling2D(**kw), lambda: SlicePool2D(**kw),
                 [x], [SPLIT4], b, m, SPLIT4)   # on 1x2 also: no collective (communicates=False)


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_slice_max_pool_in_other_float_types(dtype):
    """float64 (the parity tests of keras.applications models) and float16 (mixed precision)."""
    from tf_multigpu.parallel.split_layers import SlicePool2D
    x = tf.constant(_with_ties((2, 13, 13, 4)), dtype=dtype)
    got = []
    for layer in (keras.layers.MaxPooling2D(3, 2, dtype=dtype), SlicePool2D(3, 2, dtype=dtype)):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(y * y)
        got.append((y.numpy(), tape.gradient(loss, x).numpy()))
    np.testing.assert_array_equal(got[1][0], got[0][0])
    np.testing.assert_array_equal(got[1][1], got[0][1])


def test_inputs_no_window_reads_get_a_zero_gradient():
    """A window smaller than its stride reads no tap from some inputs: their gradient is 0, as
    the stock ops', even where dy is inf (a phase made as `phase * 0.0` was NaN there)."""
    x = tf.constant(_x((1, 7, 7, 2)))
    dy = tf.fill([1, 4, 4, 2], float("inf"))
    for mine, stock in ((lambda t: W.window_sum(t, None, (1, 1), (2, 2), "same"),
                         lambda t: tf.nn.avg_pool2d(t, 1, 2, "SAME")),
                        (lambda t: W.window_max(t, (1, 1), (2, 2), "same"),
                         lambda t: tf.nn.max_pool2d(t, 1, 2, "SAME"))):
        got = []
        for pool in (mine, stock):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = pool(x)
            got.append(tape.gradient(y, x, dy).numpy())
        np.testing.assert_array_equal(got[0], got[1])
        assert np.isinf(got[0][:, ::2, ::2]).all() and (got[0][:, 1::2] == 0).all()


def _backward_reads(layer, shape) -> list:
    """The tensors of layer's forward (on an input of `shape`) that its gradient reads."""
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            with tf.name_scope("layer"):
                y = layer(x)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, *layer.trainable_weights])

    graph = tf.function(step).get_concrete_function(tf.TensorSpec(shape)).graph
    ops = graph.get_operations()
    first_backward = next(i for i, op in enumerate(ops) if op.name.startswith("gradient_tape"))
    forward = {op.name for op in ops[:first_backward] if op.name.startswith("layer/")}
    read = {t.name for op in ops[first_backward:] for t in op.inputs if t.op.name in forward}
    return [graph.get_tensor_by_name(name) for name in sorted(read)]


def test_slice_max_pool_backward_keeps_only_its_input_and_output():
    """The gradient reads x and y of the forward, nothing else: no tap, no partial maximum
    (autodiff of the tf.maximum chain kept 2*k*k - 2 output-sized tensors)."""
    from tf_multigpu.parallel.split_layers import SlicePool2D
    read = _backward_reads(SlicePool2D(pool_size=3, strides=2), (2, 13, 13, 4))
    kept = [t.name for t in read if t.op.type not in ("Const", "IdentityN")]
    assert len(kept) <= 2, f"the backward reads more than x and y of the forward: {kept}"


def test_grouped_conv_backward_keeps_its_input_not_its_taps():
    """The gradient reads x and the kernel of the forward: autodiff of the per-tap einsums kept
    all kh*kw taps (a ResNeXt-like model's model 1x2 allocator peak: 1,002 MiB, 534 MiB
    without)."""
    shape = (2, 9, 9, 8)
    read = _backward_reads(M.SplitGroupedConv2D(8, 3, groups=4, padding="same", use_bias=False), shape)
    maps = [t.name for t in read if t.shape.num_elements() >= np.prod(shape)]
    assert len(maps) == 1, f"the backward reads more input-sized tensors of the forward than x: {maps}"


_WINDOW_PEAK = """
import json, sys
import tensorflow as tf
from tf_multigpu.parallel import windows as W
kind, stride = sys.argv[1], int(sys.argv[2])
x = tf.Variable(tf.random.normal([8, 24, 24, 64]))
kernel = tf.Variable(tf.random.normal([3, 3, 16, 64] if kind == "grouped" else [3, 3, 64, 1]))

@tf.function
def step():
    if kind == "depthwise-eval":   # the eval step's forward: unrolled, no while loop
        with W.taps_unrolled():
            return [W.depthwise_conv2d(x * 1.0, kernel, (stride, stride), "same")]
    with tf.GradientTape() as tape:
        if kind == "depthwise":
            y = W.depthwise_conv2d(x * 1.0, kernel, (stride, stride), "same")
        elif kind == "grouped":   # 4 groups of 16 channels, 64 filters
            y = W.grouped_conv2d(x * 1.0, kernel, 4, (stride, stride), "same")
        else:
            y = W.window_sum(x * 1.0, None, (3, 3), (stride, stride), "valid")
        loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, [x, kernel])

step()
tf.config.experimental.reset_memory_stats("CPU:0")
base = tf.config.experimental.get_memory_info("CPU:0")["current"]
step()[0].numpy()
print(json.dumps((tf.config.experimental.get_memory_info("CPU:0")["peak"] - base) / (x.shape.num_elements() * 4)))
"""


@pytest.mark.parametrize("kind,stride,limit", [("depthwise", 1, 8), ("depthwise", 2, 8), ("average", 1, 8),
                                               ("grouped", 2, 6.5), ("depthwise-eval", 1, 5)])
def test_window_sum_holds_one_tap_at_a_time(kind, stride, limit):
    """The allocator's peak of one window_sum fwd+bwd (plain tensors), in input maps: 4.3-6.3
    with its sums run tap by tap, 11.4-11.9 when the 9 taps of a sum were made at once (every
    slice depends on x or dy alone, so the executor ran them all as soon as it could). A
    strided grouped conv's dx runs one stride phase at a time at the output's size: 4.5-4.6
    (8.1-10.1 when it convolved the dilated dy, every einsum input-sized; 4 groups, 64 filters).
    The eval step's forward, unrolled (`taps_unrolled`), each tap waiting for the sum so far:
    4.3 input maps (11.4 with its taps made at once).
    oneDNN on, for the CPU allocator's statistics (test_memory_measured)."""
    done = run_code(_WINDOW_PEAK, kind, str(stride), env={"TF_ENABLE_ONEDNN_OPTS": "1"}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    maps = json.loads(done.stdout.strip().splitlines()[-1])
    assert maps < limit, f"{kind} 3x3/{stride}: peaked at {maps:.1f} input maps"


# -- d) merges -----------------------------------------------------------------------------
@pytest.mark.parametrize("b,m", MESHES)
@pytest.mark.parametrize("stock", [c for c in M.MERGES if c is not keras.layers.Concatenate], ids=lambda c: c.__name__)
@pytest.mark.parametrize("split_output", [True, False])
def test_merge_brings_operands_to_one_layout(devices, stock, split_output, b, m):
    """A split and a whole operand: kept split, the whole one is sliced locally, and its
    gradient all-gathered in the backward; gathered, the split one is all-gathered in the
    forward (its gradient sliced). One named all-gather of an operand's size either way."""
    def split():
        layer = M.MERGES[stock](name="merge")
        layer.split_output = split_output
        return layer
    seen = check_parity(devices, lambda: stock(name="merge"), split, [_x(), _x(seed=1)], [SPLIT4, WHOLE4], b, m,
                        SPLIT4 if split_output else WHOLE4, communicates=True)
    if split_output and seen:   # a backward relayout keeps its name in the trace; a forward one does not
        assert all("relayout/merge/activation_gradients" in name for name in seen if "DTensorAll" in name)


@pytest.mark.parametrize("b,m", MESHES)
def test_concatenate_on_channels_gathers_its_operands(devices, b, m):
    check_parity(devices, lambda: keras.layers.Concatenate(name="cat"), lambda: M.GatherConcatenate(name="cat"),
                 [_x(), _x(seed=1)], [SPLIT4, SPLIT4], b, m, WHOLE4, communicates=True)


def test_concatenate_on_another_axis_keeps_channels_split(devices):
    check_parity(devices, lambda: keras.layers.Concatenate(axis=1), lambda: M.GatherConcatenate(axis=1),
                 [_x(), _x(seed=1)], [SPLIT4, WHOLE4], 1, 2, SPLIT4, communicates=True)


# -- e) DepthwiseConv2D ------------------------------------------------------------------
DEPTHWISE = {   # MobileNetV2: 3x3 s1 same; 3x3 s2 valid after ZeroPadding2D (odd 9 -> here); also s2 same
    "3x3_s1_same": {"kernel_size": 3, "padding": "same"},
    "3x3_s2_valid": {"kernel_size": 3, "strides": 2, "padding": "valid"},
    "3x3_s2_same": {"kernel_size": 3, "strides": 2, "padding": "same"},
    "5x3_s1_valid_mult2_relu": {"kernel_size": (5, 3), "padding": "valid", "depth_multiplier": 2, "activation": "relu"},
}


@pytest.mark.parametrize("b,m", MESHES)
@pytest.mark.parametrize("name", DEPTHWISE)
def test_split_depthwise_conv_equals_keras(devices, name, b, m):
    kw = DEPTHWISE[name]
    check_parity(devices, lambda: keras.layers.DepthwiseConv2D(**kw), lambda: M.SplitDepthwiseConv2D(**kw),
                 [_x()], [SPLIT4], b, m, SPLIT4, M.SplitDepthwiseConv2D.VARIABLE_SPECS)


def test_split_depthwise_conv_after_zero_padding_like_mobilenet_v2(devices):
    """MobileNetV2's stride-2 blocks: ZeroPadding2D(((0, 1), (0, 1))) then a 3x3/2 VALID
    depthwise conv, on an even map (16 -> 17 -> 8)."""
    def model(depthwise):
        return lambda: keras.Sequential([keras.layers.ZeroPadding2D(((0, 1), (0, 1))),
                                         depthwise(kernel_size=3, strides=2, padding="valid", use_bias=False)])
    check_parity(devices, model(keras.layers.DepthwiseConv2D), model(M.SplitDepthwiseConv2D),
                 [_x((2, 16, 16, 8))], [SPLIT4], 1, 2, SPLIT4, M.SplitDepthwiseConv2D.VARIABLE_SPECS)


# -- f) SeparableConv2D and grouped Conv2D --------------------------------------------------
@pytest.mark.parametrize("b,m", MESHES)
@pytest.mark.parametrize("kw", [{"filters": 6, "kernel_size": 3, "padding": "same"},
                                {"filters": 6, "kernel_size": 3, "strides": 2, "depth_multiplier": 2}],
                         ids=["s1_same", "s2_valid_mult2"])
def test_split_separable_conv_equals_keras_with_one_all_reduce(devices, kw, b, m):
    seen = check_parity(devices, lambda: keras.layers.SeparableConv2D(name="sep", **kw),
                        lambda: M.SplitSeparableConv2D(name="sep", **kw), [_x()], [SPLIT4], b, m, WHOLE4,
                        M.SplitSeparableConv2D.VARIABLE_SPECS, communicates=True)
    assert seen is None or all("allreduce/sep/activations" in name for name in seen if "DTensorAll" in name)


@pytest.mark.parametrize("b,m", MESHES)
@pytest.mark.parametrize("kw", [{"filters": 6, "kernel_size": 3, "padding": "same"},
                                {"filters": 6, "kernel_size": 3, "strides": 2, "depth_multiplier": 2}],
                         ids=["s1_same", "s2_valid_mult2"])
@pytest.mark.parametrize("split_input", [False, True], ids=["whole_input", "split_input"])
def test_filter_split_separable_conv_equals_keras(devices, kw, split_input, b, m):
    """filter_split's SeparableConv2D (Xception's): the pointwise kernel split on its filters, the
    input gathered first, the output split; backward, the depthwise output's gradient is
    all-reduced."""
    check_parity(devices, lambda: keras.layers.SeparableConv2D(name="sep", **kw),
                 lambda: M.FilterSplitSeparableConv2D(name="sep", **kw), [_x()], [SPLIT4 if split_input else WHOLE4],
                 b, m, SPLIT4, M.FilterSplitSeparableConv2D.VARIABLE_SPECS, communicates=True)


GROUPED = {
    "g2_3x3_same": {"filters": 8, "kernel_size": 3, "padding": "same", "groups": 2},
    "g4_3x3_s2_valid": {"filters": 12, "kernel_size": 3, "strides": 2, "groups": 4},
    "g8_1x1": {"filters": 16, "kernel_size": 1, "groups": 8, "activation": "relu"},
}


@pytest.mark.parametrize("b,m", MESHES)
@pytest.mark.parametrize("name", GROUPED)
def test_split_grouped_conv_equals_keras(devices, name, b, m):
    kw = GROUPED[name]
    check_parity(devices, lambda: keras.layers.Conv2D(**kw), lambda: M.SplitGroupedConv2D(**kw),
                 [_x()], [SPLIT4], b, m, SPLIT4, M.SplitGroupedConv2D.VARIABLE_SPECS)


# -- checkpoints and errors --------------------------------------------------------------
@pytest.mark.parametrize("stock,split,kw", [
    (keras.layers.DepthwiseConv2D, M.SplitDepthwiseConv2D, {"kernel_size": 3}),
    (keras.layers.SeparableConv2D, M.SplitSeparableConv2D, {"filters": 4, "kernel_size": 3}),
    (keras.layers.Conv2D, M.SplitGroupedConv2D, {"filters": 4, "kernel_size": 3, "groups": 2}),
    (keras.layers.AveragePooling2D, M.SliceAvgPool2D, {"pool_size": 2}),
    (keras.layers.Add, M.SplitAdd, {}),
    (keras.layers.Concatenate, M.GatherConcatenate, {}),
], ids=lambda v: getattr(v, "__name__", ""))
def test_split_layers_keep_the_stock_weights_names_and_config(stock, split, kw):
    a, b = stock(name="layer", **kw), split.from_config(stock(name="layer", **kw).get_config())   # as the plan swaps
    assert isinstance(b, stock) and a.get_config() == b.get_config()
    if stock is not keras.layers.Conv2D:   # a grouped Conv2D is the plan's choice (test_placement)
        assert M.SPLIT_AWARE[stock] is split
    if a.weights or hasattr(a, "kernel_size"):
        a.build((1, 8, 8, 4))
        b.build((1, 8, 8, 4))
        assert [(w.path, w.shape) for w in a.weights] == [(w.path, w.shape) for w in b.weights]
        assert set(split.VARIABLE_SPECS) <= {w.name for w in b.weights}


@pytest.mark.parametrize("make", [lambda: M.SplitDepthwiseConv2D(3, dilation_rate=2, name="layer"),
                                  lambda: M.SplitGroupedConv2D(4, 3, groups=2, data_format="channels_first",
                                                               name="layer"),
                                  lambda: M.SliceAvgPool2D(2, data_format="channels_first", name="layer")],
                         ids=["dilation", "channels_first", "avg_pool_channels_first"])
def test_unsupported_geometry_is_a_one_line_error_with_the_fix(make):
    """Raised when the plan builds the layer (from_config), before any step runs."""
    with pytest.raises(UsageError, match="layer layer: .*: (replicate|build)") as e:
        make()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("b,m", MESHES)
def test_a_mobilenet_v2_like_block_on_split_channels_equals_one_device(devices, b, m):
    """The layers together, as the plan will chain them: ZeroPadding2D, a 3x3/2 depthwise
    conv, BatchNorm (training), ReLU6, a residual Add with an average-pooled shortcut, global
    average pooling, all on split channels: exact, and no `model` traffic at all."""
    mesh = _mesh(devices, b, m)

    def block(split):
        inp = keras.Input((16, 16, 8))
        x = keras.layers.ZeroPadding2D(((0, 1), (0, 1)))(inp)
        dw = (M.SplitDepthwiseConv2D if split else keras.layers.DepthwiseConv2D)(3, 2, use_bias=False, name="dw")
        x = keras.layers.ReLU(6.0)(keras.layers.BatchNormalization(name="bn")(dw(x)))
        pool = (M.SliceAvgPool2D if split else keras.layers.AveragePooling2D)(2, name="pool")
        add = (M.SplitAdd if split else keras.layers.Add)(name="add")
        for layer in (dw, pool, add):
            layer.mesh = mesh
        x = add([x, pool(inp)])
        return keras.Model(inp, keras.layers.GlobalAveragePooling2D()(x), name="block")

    specs = {**M.SplitDepthwiseConv2D.VARIABLE_SPECS, **M.STOCK_VARIABLE_SPECS[keras.layers.BatchNormalization]}
    check_parity(devices, lambda: block(False), lambda: block(True), [_x((4, 16, 16, 8))], [SPLIT4], b, m,
                 ["batch", "model"], specs, training=True, communicates=False)


def test_grouped_conv_whose_groups_do_not_divide_the_model_axis_is_refused(devices):
    layer = M.SplitGroupedConv2D(6, 3, groups=3, name="layer")
    layer.mesh = _mesh(devices, 1, 2)
    with pytest.raises(UsageError, match="layer layer: groups=3 does not divide by the 2 devices .*: replicate") as e:
        layer.build((1, 8, 8, 6))
    assert "\n" not in str(e.value)
