"""What each layer's backward reads of its own forward pass, so what the runtime keeps alive
from the forward until the backward (RQ5's memory estimate, `parallel/memory.py`).

TensorFlow keeps a forward tensor exactly as long as some gradient op reads it. Which tensors a
layer's gradient reads depends on its ops, not on the model: a convolution's kernel gradient
reads its input, ReluGrad reads the ReLU's output, BatchNormalization's gradient reads its
input but never its output, an add or a concatenation reads neither. A tensor is kept when its
producer's backward reads it as an output or any consumer's as an input; counting every
layer's output instead over-counted a Conv -> BatchNorm -> ReLU block twice (4 maps where 2
are kept, BUILD_NOTES.md, "Twenty-second session").

Each entry below is what TensorFlow 2.21's gradient graph of the stock Keras 3 layer reads, as
`tests/test_backward_reads.py` traces it (it fails when an entry and the trace disagree). A
layer or operation not in the table keeps its inputs and its output: the safe side.
"""

from __future__ import annotations

import dataclasses
import math

import keras

L = keras.layers


@dataclasses.dataclass(frozen=True)
class Reads:
    """What one layer's backward reads of its forward, per example."""

    inputs: bool = False   # its inputs (a kernel's gradient; Multiply; MaxPool's argmax)
    output: bool = False   # its output (ReLU, sigmoid, tanh, softmax, MaxPool)
    own: float = 0.0       # tensors of its own, in units of its output's size (a bool mask: 0.25;
                           # a map of zeros a gradient builds from shapes alone is made during the
                           # forward, as soon as it can run, and counts too)
    own_in: float = 0.0    # ... in units of its input's size (GlobalMaxPooling's argmax indicator)
    alias: bool = False    # its output is a view of its input, no new tensor (Flatten, Reshape)


NOTHING = Reads()
UNKNOWN = Reads(inputs=True, output=True)
_BOOL = 0.25   # a bool mask against a float32 map

# Activation functions by their serialised name: what their gradient reads of their input
# (the layer's pre-activation, where the function is a layer's `activation`) and output.
ACTIVATIONS = {
    "linear": NOTHING,
    **{name: Reads(output=True) for name in ("relu", "relu6", "sigmoid", "tanh", "softmax", "elu", "selu",
                                              "exponential")},
    "leaky_relu": Reads(inputs=True),
    "softsign": Reads(inputs=True),
    "softplus": Reads(own=1),               # its sigmoid
    "log_softmax": Reads(own=1),            # its exp
    # tf.nn.silu's gradient recomputes sigmoid(x) from x. Its graph also reads beta * x and x^2
    # (for beta's gradient), which Grappler removes: beta is the constant 1 and its gradient
    # is never used (measured: a Conv -> BN -> swish block keeps 3 maps, as leaky_relu's).
    "silu": Reads(inputs=True),
    "mish": Reads(inputs=True, own=2),      # its sigmoid and tanh
    "gelu": Reads(own=3),
    "hard_sigmoid": Reads(own=2),
    "hard_silu": Reads(inputs=True, own=3),
}

# Stock layers without an activation, by class (first match).
_LAYERS = (
    ((L.BatchNormalization,), Reads(inputs=True)),   # its statistics are per channel: small
    ((L.LayerNormalization,), Reads(inputs=True, own=1)),
    ((L.Dropout,), Reads(own=_BOOL)),                # its keep mask
    ((L.MaxPooling1D, L.MaxPooling2D, L.MaxPooling3D), Reads(inputs=True, output=True)),
    ((L.AveragePooling1D, L.AveragePooling2D, L.AveragePooling3D, L.GlobalAveragePooling1D,
      L.GlobalAveragePooling2D, L.GlobalAveragePooling3D, L.ZeroPadding1D, L.ZeroPadding2D, L.ZeroPadding3D,
      L.Cropping1D, L.Cropping2D, L.Cropping3D, L.UpSampling1D, L.UpSampling2D, L.UpSampling3D, L.Rescaling,
      L.Permute, L.Add, L.Subtract, L.Concatenate), NOTHING),
    ((L.Flatten, L.Reshape), Reads(alias=True)),
    ((L.Multiply,), Reads(inputs=True)),
    ((L.Average,), Reads(own=1)),                    # the sum divided by N
    ((L.Maximum, L.Minimum), Reads(own=1 + _BOOL)),  # which operand was taken, and a map of zeros
    ((L.GlobalMaxPooling1D, L.GlobalMaxPooling2D, L.GlobalMaxPooling3D), Reads(own_in=1)),
    ((L.LeakyReLU,), Reads(inputs=True)),
    ((L.ELU, L.Softmax), Reads(output=True)),
)

# Layers whose kernel gradient reads their input, then their `activation`. A frozen convolution
# keeps its input too: Conv2DBackpropInputV2 takes the input tensor itself for its shape.
_WEIGHTED = (L.Conv1D, L.Conv2D, L.Conv3D, L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose,
             L.DepthwiseConv2D, L.SeparableConv2D, L.Dense)

# Bare operations in a functional graph (`x + 3.0`, `keras.ops.relu(x)`), by class name; a
# multiplication reads its operands only where both are tensors of the graph.
_OPERATIONS = {
    "Add": NOTHING, "Subtract": NOTHING, "Mean": NOTHING,
    "Relu": Reads(output=True), "Relu6": Reads(output=True), "Sigmoid": Reads(output=True),
    "Tanh": Reads(output=True),
    "Clip": Reads(own=2 * (1 + _BOOL)),   # where x was below and above the bounds, two maps of zeros
    "Divide": Reads(own=1), "TrueDivide": Reads(own=1),
    "Silu": ACTIVATIONS["silu"], "HardSigmoid": ACTIVATIONS["hard_sigmoid"],
}


def has_inner_activation(node) -> bool:
    """A convolution or dense layer with a non-linear `activation` of its own."""
    return issubclass(node.cls, _WEIGHTED) and node.config.get("activation", "linear") not in ("linear", None)


def activation_reads(name) -> Reads:
    """An activation function's reads; a user's function (a serialised dict) is unknown."""
    return ACTIVATIONS.get(name, UNKNOWN) if isinstance(name, str) else UNKNOWN


def layer_reads(node) -> Reads:
    """What `node`'s (a placement Node: stock class, config, inputs) backward reads; its
    pre-activation, where an activation reads it, counts as a tensor of its own."""
    cls, config = node.cls, node.config
    if not issubclass(cls, L.Layer):
        if cls.__name__ == "Multiply":
            return Reads(inputs=len(node.inputs) > 1)
        return _OPERATIONS.get(cls.__name__, UNKNOWN)
    if issubclass(cls, _WEIGHTED):
        act = activation_reads(config.get("activation", "linear"))
        return Reads(inputs=True, output=act.output,
                     own=act.own + (1 if act.inputs else 0))
    if issubclass(cls, L.Activation):
        return activation_reads(config.get("activation"))
    if issubclass(cls, L.ReLU):
        return _relu_reads(config)
    if issubclass(cls, L.Dropout) and config.get("noise_shape"):   # a mask broadcast over the
        mask = [n if d is None else d for n, d in zip(node.out_shape, config["noise_shape"][1:])]   # map
        return Reads(own=_BOOL * math.prod(mask) / node.out_elems)
    return next((reads for classes, reads in _LAYERS if issubclass(cls, classes)), UNKNOWN)


def _relu_reads(config) -> Reads:
    """keras.layers.ReLU: tf.nn.relu or relu6 (its output) unless a slope, a threshold or
    another cap makes it a composition (ReLU.static_call)."""
    slope, cap, threshold = (config.get("negative_slope", 0.0), config.get("max_value"),
                             config.get("threshold", 0.0))
    if not slope and not threshold and cap in (None, 6, 6.0):
        return Reads(output=True)
    if slope and cap is None and not threshold:
        return Reads(inputs=True)   # leaky_relu
    return UNKNOWN
