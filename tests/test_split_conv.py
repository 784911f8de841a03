"""The filter-split convolution equals tf.nn.conv2d (y, dx, dw) for every geometry our models
use, on one device and with its kernel split on output channels over 1x2, 1x4 and 2x2 DTensor
meshes, whole or in chunks of output rows; it keeps only its input for the backward and its
input gradient crosses `model` in all-reduces that add up to the input's size."""

import json
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from tests.launcher import run_code
from tf_multigpu.parallel.split_conv import split_conv2d

pytestmark = pytest.mark.in_process_mesh   # its tests build DTensor meshes in this process
U = dtensor.UNSHARDED
# (batch, H, W, cin, cout, kh, kw, stride, padding): AlexNet's conv1 (11x11/4 on 227 and 224),
# 5x5 and 3x3 SAME, and odd strides, rectangles and 1x1 that the same code must get right.
CASES = {
    "alexnet_conv1_227": (2, 227, 227, 3, 8, 11, 11, 4, "VALID"),
    "conv1_224_same": (2, 224, 224, 3, 8, 11, 11, 4, "SAME"),
    "5x5_s1_same": (2, 13, 13, 6, 8, 5, 5, 1, "SAME"),
    "3x3_s1_same": (2, 9, 9, 6, 8, 3, 3, 1, "SAME"),
    "3x3_s2_same_odd": (2, 9, 11, 5, 8, 3, 3, 2, "SAME"),
    "rect_3x5_valid": (2, 10, 12, 5, 8, 3, 5, 1, "VALID"),
    "2x2_s3_same": (2, 10, 10, 3, 8, 2, 2, 3, "SAME"),
    "1x1": (2, 6, 6, 5, 8, 1, 1, 1, "SAME"),
}


def _data(case):
    b, h, w, ci, co, kh, kw, s, pad = case
    rs = np.random.RandomState(0)
    x = rs.randn(b, h, w, ci).astype(np.float32)
    k = (rs.randn(kh, kw, ci, co) / np.sqrt(kh * kw * ci)).astype(np.float32)
    return tf.constant(x), tf.constant(k), s, pad


def _forward_backward(conv, x, k, s, pad):
    with tf.GradientTape() as tape:
        tape.watch([x, k])
        y = conv(x, k, s, pad)
        loss = tf.reduce_sum(y * tf.sin(y))   # a non-trivial upstream gradient
    dx, dk = tape.gradient(loss, [x, k])
    return y, dx, dk


def _assert_close(got, want, name):
    err = np.abs(np.asarray(got) - np.asarray(want)).max() / max(1.0, np.abs(np.asarray(want)).max())
    assert err < 2e-5, f"{name}: max error {err:.2e} relative to max |ref|"


def _chunked(chunk_bytes):
    return lambda x, k, s, pad: split_conv2d(x, k, s, pad, chunk_bytes=chunk_bytes)


# 1 byte: one output row per chunk (the most chunks); 4 KiB: chunks of several rows, uneven.
CHUNKS = {"whole": 2**40, "row_by_row": 1, "4KiB": 4096}


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("name", CASES)
def test_equals_tf_nn_conv2d(name, chunks):
    x, k, s, pad = _data(CASES[name])
    want = _forward_backward(tf.nn.conv2d, x, k, s, pad)
    got = _forward_backward(_chunked(CHUNKS[chunks]), x, k, s, pad)
    for g, w, what in zip(got, want, ("y", "dx", "dw")):
        _assert_close(g, w, f"{name} {chunks} {what}")


def test_first_layer_computes_no_input_gradient():
    x, k, s, pad = _data(CASES["alexnet_conv1_227"])
    with tf.GradientTape() as tape:
        tape.watch([x, k])
        loss = tf.reduce_sum(split_conv2d(x, k, s, pad, need_input_grad=False) ** 2)
    dx, dk = tape.gradient(loss, [x, k])
    assert dx is None
    with tf.GradientTape() as tape:
        tape.watch(k)
        loss = tf.reduce_sum(tf.nn.conv2d(x, k, s, pad) ** 2)
    _assert_close(dk, tape.gradient(loss, k), "dw without dx")


def test_backward_keeps_the_input_not_patches():
    """What the gradient function closes over is x and the kernel: no tensor of the forward
    pass that is bigger than x (a patch matrix) survives into the backward."""
    x, k, s, pad = _data(CASES["5x5_s1_same"])

    def scoped(a, b, s, pad):
        with tf.name_scope("conv"):
            return split_conv2d(a, b, s, pad, chunk_bytes=1)

    graph = tf.function(lambda a, b: _forward_backward(scoped, a, b, s, pad)).get_concrete_function(
        tf.TensorSpec(x.shape), tf.TensorSpec(k.shape)).graph
    x_size = int(np.prod(x.shape))
    ops = graph.get_operations()
    first_backward = next(i for i, op in enumerate(ops) if op.name.startswith("gradient_tape"))
    forward = {op.name for op in ops[:first_backward] if op.type == "Placeholder" or
               op.name.startswith("conv/") and op.type != "IdentityN"}   # x, kernel, the conv's inner tensors; not y
    read = {t.name: t for op in ops[first_backward:] for t in op.inputs if t.op.name in forward}
    assert any(t.shape == x.shape for t in read.values() if t.op.type == "Placeholder"), \
        f"the backward does not read x: {sorted(read)}"
    for t in read.values():
        assert int(np.prod(t.shape)) <= x_size, f"the backward reads {t.name} {t.shape}, bigger than x"


@pytest.mark.parametrize("batch_groups", [1, 2])
def test_weight_gradient_chunks_run_one_after_another(batch_groups):
    """Each chunk of the weight gradient gathers its patches only after the previous chunk's
    product (a grouped einsum, or one MatMul without groups): one chunk of patches alive at a
    time (the executor may otherwise run the cheap gathers ahead; TensorFlow's own CPU kernels
    did, holding 14 of conv2's chunks at once)."""
    x, k, s, pad = _data(CASES["5x5_s1_same"])

    def conv(a, b, s, pad):
        return split_conv2d(a, b, s, pad, chunk_bytes=1, batch_groups=batch_groups)

    graph = tf.function(lambda a, b: _forward_backward(conv, a, b, s, pad)).get_concrete_function(
        tf.TensorSpec(x.shape), tf.TensorSpec(k.shape)).graph
    def weight_grad(op):   # dW's, one per output row: [groups, taps, cin, cout] or [taps * cin, cout]
        if batch_groups > 1:
            return op.type == "Einsum" and op.get_attr("equation") == b"gbhwtc,gbhwd->gtcd"
        return op.type == "MatMul" and op.get_attr("transpose_a")

    products = [op for op in graph.get_operations() if weight_grad(op)]
    # each one's patches: a GatherV2, reshaped to [B, rows, cols, taps, cin], then into groups or rows
    gathers = [e.inputs[0].op.inputs[0].op.inputs[0].op for e in products]
    assert len(products) == 13 and {g.type for g in gathers} == {"GatherV2"}

    def upstream(op):
        seen, todo = set(), [op]
        while todo:
            for t in todo.pop().inputs:
                if t.op not in seen:
                    seen.add(t.op)
                    todo.append(t.op)
        return seen

    waits = [products[i - 1] in upstream(gathers[i]) for i in range(1, 13)]
    assert waits == [True] * 12, waits


MESHES = {"1x2": (1, 2), "1x4": (1, 4), "2x2": (2, 2)}


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("name", ["alexnet_conv1_227", "5x5_s1_same", "3x3_s2_same_odd"])
def test_kernel_split_on_output_channels(name, mesh_shape, devices):
    nb, nm = MESHES[mesh_shape]
    mesh = dtensor.create_mesh([("batch", nb), ("model", nm)],
                               devices=[d.split("device:")[-1] for d in devices[:nb * nm]])
    x, k, s, pad = _data(CASES[name])
    want = _forward_backward(tf.nn.conv2d, x, k, s, pad)

    def put(t, specs):
        rep = dtensor.copy_to_mesh(t, dtensor.Layout.replicated(mesh, t.shape.rank))
        return dtensor.relayout(rep, dtensor.Layout(specs, mesh))

    xd, kd = put(x, ["batch", U, U, U]), put(k, [U, U, U, "model"])
    # several chunks (about 5 rows each), each a separate einsum DTensor must lay out
    b, h, w, ci, co, kh, kw = CASES[name][:7]
    chunk = b * w * kh * kw * max(ci, co) * 4 * 5
    y, dx, dk = tf.function(lambda a, b: _forward_backward(_chunked(chunk), a, b, s, pad))(xd, kd)
    assert dtensor.fetch_layout(y).sharding_specs == ["batch", U, U, "model"]
    assert dtensor.fetch_layout(dk).sharding_specs == [U, U, U, "model"]
    assert dtensor.fetch_layout(dx).sharding_specs == ["batch", U, U, U]
    assert dtensor.unpack(y)[0].shape[-1] == want[0].shape[-1] // nm   # each device: 1/nm of the channels

    def full(t):
        return dtensor.unpack(dtensor.relayout(t, dtensor.Layout.replicated(mesh, t.shape.rank)))[0]

    for g, w, what in zip((y, dx, dk), want, ("y", "dx", "dw")):
        _assert_close(full(g), w, f"{name} {what}")


_COLLECTIVES_WORKER = textwrap.dedent("""
    import json, sys
    from tf_multigpu.profiling import collectives
    collectives.enable_graph_dumps()   # before TensorFlow runs anything
    import tensorflow as tf
    from tensorflow.experimental import dtensor
    from tf_multigpu.parallel.split_conv import split_conv2d
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    U = dtensor.UNSHARDED
    mesh = dtensor.create_mesh([("batch", 2), ("model", 2)], devices=[f"CPU:{i}" for i in range(4)])
    def put(t, specs):
        return dtensor.relayout(dtensor.copy_to_mesh(t, dtensor.Layout.replicated(mesh, t.shape.rank)),
                                dtensor.Layout(specs, mesh))
    x = put(tf.random.normal([4, 13, 13, 16]), ["batch", U, U, U])
    k = put(tf.random.normal([5, 5, 16, 8]), [U, U, U, "model"])
    @tf.function
    def train_step(x, k):   # the name the graph dump filters on
        with tf.GradientTape() as tape:
            tape.watch([x, k])
            loss = tf.reduce_sum(split_conv2d(x, k, 1, "SAME", chunk_bytes=int(sys.argv[1]), batch_groups=2) ** 2)
        return tape.gradient(loss, [x, k])
    train_step(x, k)
    print(json.dumps([[c.op, c.payload_bytes, c.name[-60:]] for c in collectives.read_lowered_step(4)]))
""")


@pytest.mark.slow
@pytest.mark.parametrize("chunks", ["whole", "row_by_row"])
def test_input_gradient_all_reduces_add_up_to_the_input(chunks):
    """In DTensor's SPMD-expanded step on a 2x2 mesh: the all-reduces of dx over `model` sum
    to x's size per device (one per chunk, never one per tap), dw's partial sums over `batch`
    are one all-reduce of the local kernel shard, and nothing else crosses devices but the
    4-byte scalars that make each chunk wait for the previous one."""
    done = run_code(_COLLECTIVES_WORKER, str(CHUNKS[chunks]))
    assert done.returncode == 0, done.stderr[-2000:]
    found = [c[:2] for c in json.loads(done.stdout.strip().splitlines()[-1])]   # [op, bytes, name]
    x_bytes, dw_bytes = 2 * 13 * 13 * 16 * 4, 5 * 5 * 16 * 4 * 4   # per device: half the batch, half cout
    dw = [size for _, size in found if size == dw_bytes]
    tokens = [size for _, size in found if size == 4]   # the scalars that order the chunks
    dx = [size for _, size in found if size not in (dw_bytes, 4)]
    assert all(op == "all_reduce" for op, _ in found), found
    assert len(dw) == 1, found
    assert sum(dx) == x_bytes, found
    n = 1 if chunks == "whole" else 13   # 13 output rows
    assert len(dx) == n, found
    assert len(tokens) <= 3 * n, found   # at most one per chunk and pass
