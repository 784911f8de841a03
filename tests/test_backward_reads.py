"""The memory estimate's table of what each layer's backward reads (parallel/backward_reads.py)
against TensorFlow's own gradient graph: for every entry, the forward tensors the traced
gradient ops consume (the layer's inputs, its output, tensors of its own) must be what the
table says. A TensorFlow or Keras upgrade that changes a gradient fails here."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_multigpu.parallel.backward_reads import ACTIVATIONS, UNKNOWN, Reads, layer_reads
from tf_multigpu.parallel.placement import make_plan

L = keras.layers
BATCH = 3
MAP = (6, 6, 16)       # 16 channels: per-position statistics (1/16 of a map) are below SMALL
SMALL = 0.2            # kept tensors under this fraction of the output are not counted (the table
                       # may count them: they differ by less than 0.02 of the output here)


class _Op(keras.layers.Layer):
    """A bare operation as a layer, to trace it alone."""

    def __init__(self, fn):
        super().__init__(name="bare_op")
        self.fn = fn

    def call(self, x):
        return self.fn(x)


def traced_reads(layer, in_shapes) -> Reads:
    """The forward tensors the gradient ops of `layer` (inputs and weights) read, as Reads:
    an op is backward where it depends on the output's gradient, a placeholder of its own.
    Tensors of its own are summed, in units of its output."""
    multi = len(in_shapes) > 1
    zeros = [tf.zeros((BATCH,) + s) for s in in_shapes]
    out_shape = layer(zeros if multi else zeros[0], training=True).shape

    def step(dy, *xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = layer(list(xs) if multi else xs[0], training=True)
        grads = tape.gradient(y, list(xs) + list(layer.trainable_weights), output_gradients=dy)
        return y, [g for g in grads if g is not None]

    specs = [tf.TensorSpec(out_shape)] + [tf.TensorSpec((BATCH,) + s) for s in in_shapes]
    fn = tf.function(step).get_concrete_function(*specs)
    graph, backward = fn.graph, set()
    for op in graph.get_operations():   # in topological order
        if op is graph.inputs[0].op or any(t.op in backward for t in op.inputs) or \
                any(c in backward for c in op.control_inputs):
            backward.add(op)
    inputs = {t.name for t in graph.inputs[1:len(specs)]}
    outputs, op = {fn.outputs[0].name}, fn.outputs[0].op
    while op.type == "Identity":
        op = op.inputs[0].op
        outputs.add(op.outputs[0].name)
    out_elems = int(np.prod(out_shape[1:]))
    reads_in = reads_out = False
    own = {}
    for consumer in backward:
        for t in consumer.inputs:
            if t.op in backward or t.op.type in ("ReadVariableOp", "Const") or t.dtype not in (tf.float32, tf.bool) \
                    or not t.shape.rank or t.shape[0] != BATCH:
                continue
            if t.name in inputs:
                reads_in = True
            elif t.name in outputs:
                reads_out = True
            else:
                own[t.name] = int(np.prod(t.shape[1:])) * (0.25 if t.dtype == tf.bool else 1)
    own = sum(n for n in own.values() if n >= SMALL * out_elems)
    return Reads(inputs=reads_in, output=reads_out, own=own / out_elems)


# What the traced graph reads and Grappler removes before it runs, in maps of the output:
# tf.nn.silu's gradient reads beta * x and x^2 for beta's gradient, which is never used (beta is
# the constant 1). Measured instead (allocator peak per Conv -> BN -> swish block, BUILD_NOTES).
PRUNED = {"activation_silu": 2, "conv_silu": 2, "Silu": 2}


def planned_reads(layer, in_shapes) -> Reads:
    """The table's entry for `layer`, read from the Node the placement plan makes of it."""
    inputs = [keras.Input(s) for s in in_shapes]
    model = keras.Model(inputs, layer(inputs if len(inputs) > 1 else inputs[0]))
    plan = make_plan(model, "", [], {"batch": 1, "model": 1})
    node = plan[layer.name].node
    reads = layer_reads(node)
    # as the trace counts them: tensors of its own in units of its output, a separable's
    # depthwise output (which memory.py counts on its own) among them
    own = reads.own + (reads.own_in * node.in_elems + node.depthwise_elems) / node.out_elems
    return Reads(reads.inputs, reads.output, own)


ONE, TWO, FLAT = [MAP], [MAP, MAP], [(24,)]
LAYERS = {
    "conv": (lambda: L.Conv2D(8, 3, padding="same"), ONE),
    "conv_frozen": (lambda: L.Conv2D(8, 3, padding="same", activation="relu", trainable=False), ONE),
    "conv_strided": (lambda: L.Conv2D(8, 3, strides=2, activation="relu"), ONE),
    "dense_relu": (lambda: L.Dense(8, activation="relu"), FLAT),
    "depthwise_relu6": (lambda: L.DepthwiseConv2D(3, padding="same", activation="relu6"), ONE),
    "separable": (lambda: L.SeparableConv2D(8, 3, padding="same"), ONE),
    "conv_transpose": (lambda: L.Conv2DTranspose(8, 3, strides=2), ONE),
    "batch_norm": (lambda: L.BatchNormalization(), ONE),
    "layer_norm": (lambda: L.LayerNormalization(), ONE),
    "dropout": (lambda: L.Dropout(0.5), ONE),
    "dropout_per_channel": (lambda: L.Dropout(0.5, noise_shape=(None, 1, 1, 16)), ONE),
    "max_pool": (lambda: L.MaxPooling2D(2), ONE),
    "avg_pool": (lambda: L.AveragePooling2D(2), ONE),
    "global_avg_pool": (lambda: L.GlobalAveragePooling2D(), ONE),
    "global_max_pool": (lambda: L.GlobalMaxPooling2D(), ONE),
    "zero_padding": (lambda: L.ZeroPadding2D(1), ONE),
    "cropping": (lambda: L.Cropping2D(1), ONE),
    "upsampling": (lambda: L.UpSampling2D(2), ONE),
    "rescaling": (lambda: L.Rescaling(0.5), ONE),
    "permute": (lambda: L.Permute((2, 1, 3)), ONE),
    "flatten": (lambda: L.Flatten(), ONE),
    "reshape": (lambda: L.Reshape((36, 16)), ONE),
    "add": (lambda: L.Add(), TWO),
    "subtract": (lambda: L.Subtract(), TWO),
    "concatenate": (lambda: L.Concatenate(), TWO),
    "multiply": (lambda: L.Multiply(), TWO),
    "average": (lambda: L.Average(), TWO),
    "maximum": (lambda: L.Maximum(), TWO),
    "minimum": (lambda: L.Minimum(), TWO),
    "relu": (lambda: L.ReLU(), ONE),
    "relu6": (lambda: L.ReLU(6.0), ONE),
    "relu_leaky": (lambda: L.ReLU(negative_slope=0.1), ONE),
    "leaky_relu": (lambda: L.LeakyReLU(), ONE),
    "elu": (lambda: L.ELU(), ONE),
    "softmax": (lambda: L.Softmax(), ONE),
    **{f"activation_{name}": (lambda name=name: L.Activation(name), ONE) for name in ACTIVATIONS},
    **{f"conv_{name}": (lambda name=name: L.Conv2D(8, 3, padding="same", activation=name), ONE)
       for name in ("silu", "sigmoid", "gelu", "hard_silu")},
}


@pytest.mark.parametrize("case", sorted(LAYERS))
def test_each_layer_reads_what_its_gradient_graph_reads(case):
    make, in_shapes = LAYERS[case]
    layer = make()
    planned = planned_reads(layer, in_shapes)
    traced = traced_reads(layer, in_shapes)
    assert (planned.inputs, planned.output, planned.own) == pytest.approx(
        (traced.inputs, traced.output, traced.own - PRUNED.get(case, 0)), abs=0.02), (planned, traced)
    if case.startswith("activation_"):   # every activation's entry, not the unknown default
        assert planned != UNKNOWN or case == "activation_linear"


# Bare operations of a functional graph: (the graph's call, the same call on tensors)
OPERATIONS = {
    "Add": lambda x: x + 3.0,
    "Subtract": lambda x: x - 3.0,
    "Multiply": lambda x: x * np.float32(1.5),
    "Mean": lambda x: keras.ops.mean(x, axis=(1, 2), keepdims=True),
    "Relu": keras.ops.relu,
    "Relu6": keras.ops.relu6,
    "Sigmoid": keras.ops.sigmoid,
    "Tanh": keras.ops.tanh,
    "Clip": lambda x: keras.ops.clip(x, 0.0, 6.0),
    "Divide": lambda x: keras.ops.divide(x, 6.0),
    "TrueDivide": lambda x: x / 6.0,
    "Silu": keras.ops.silu,
    "HardSigmoid": keras.ops.hard_sigmoid,
}


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_each_bare_operation_reads_what_its_gradient_graph_reads(name):
    fn = OPERATIONS[name]
    inputs = keras.Input(MAP)
    model = keras.Model(inputs, L.Conv2D(4, 1, name="head")(fn(L.Conv2D(16, 1, name="stem")(inputs))))
    plan = make_plan(model, "", [], {"batch": 1, "model": 1})
    nodes = [p.node for p in plan.layers if not issubclass(p.node.cls, L.Layer)]
    assert [n.cls.__name__ for n in nodes] == [name]
    planned, traced = layer_reads(nodes[0]), traced_reads(_Op(fn), ONE)
    assert planned == dataclasses.replace(traced, own=traced.own - PRUNED.get(name, 0)), (planned, traced)
    assert planned != UNKNOWN


def test_a_product_of_two_tensors_reads_both():
    inputs = keras.Input(MAP)
    x = L.Conv2D(16, 1, name="stem")(inputs)
    model = keras.Model(inputs, keras.ops.multiply(x, keras.ops.sigmoid(x)))
    node = [p.node for p in make_plan(model, "", [], {"batch": 1, "model": 1}).layers
            if p.node.cls.__name__ == "Multiply"][0]
    assert layer_reads(node) == traced_reads(_Op(lambda xs: xs[0] * xs[1]), TWO) == Reads(inputs=True)


def test_a_users_layer_keeps_its_inputs_and_output():
    class Scale(keras.layers.Layer):
        def call(self, x):
            return x * 2.0

    inputs = keras.Input(MAP)
    model = keras.Model(inputs, Scale(name="scale")(L.Conv2D(16, 1)(inputs)))
    assert layer_reads(make_plan(model, "", [], {"batch": 1, "model": 1})["scale"].node) == UNKNOWN
