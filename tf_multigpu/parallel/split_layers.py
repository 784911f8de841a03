"""Keras layers that run on channel-split activations under DTensor: the split-aware twins the
placement plan swaps in for stock layers (models stay plain Keras), and the layout helpers
they share.

Activations are NHWC (or [B, units]) with the batch on mesh axis `batch` and the channels
either split on `model` or whole. What each stock layer needs there (tests/test_split_layers.py
checks every row on 1x2 and 2x2 meshes against one device):

  runs unchanged (placement.ELEMENTWISE), output stays split, no `model` traffic:
      BatchNormalization (per-channel statistics; DTensor's reduction over the batch-sharded
      dim all-reduces them over `batch`, so they are the global batch's, moving averages
      included), Activation, ReLU, LeakyReLU, ELU, Rescaling, ZeroPadding2D, Cropping2D,
      Identity, GlobalAveragePooling2D, GlobalMaxPooling2D, Dropout and SpatialDropout2D
      (made stateless by the converter), GaussianNoise/GaussianDropout (their own noise per
      device), and any merge whose operands already share one layout.
  replaced, with a kernel split on output channels (filter_split):
      Conv2D            -> SplitConv2D           (DTensor refuses a sharded filter in Conv2D:
                                                 `split_conv.split_conv2d`; input gathered)
  replaced (DTensor refuses the stock op on split channels; parallel/windows.py's ops):
      MaxPooling2D      -> SlicePool2D           (MaxPool: "Only replicated or batch parallel
                                                 layout is supported")
      AveragePooling2D  -> SliceAvgPool2D        (AvgPoolGrad has no layout propagation)
      DepthwiseConv2D   -> SplitDepthwiseConv2D  (DepthwiseConv2dNativeBackprop* neither)
      SeparableConv2D   -> SplitSeparableConv2D   (FilterSplitSeparableConv2D where filter_split
                                                 splits its pointwise kernel on its filters)
      Conv2D(groups>1)  -> SplitGroupedConv2D    (Conv2D refuses a sharded filter)
  replaced to make a relayout deliberate and named (`relayout/<layer>/activations`):
      Add, Subtract, Multiply, Average, Maximum, Minimum -> Split<Merge> (operands to one
      layout: `split_output`), Concatenate -> GatherConcatenate (channel axis: gathered);
      Gather<Class> (GatherFirst + any stock layer: Conv2D, Dense, Flatten...) after a split
      layer: one explicit all-gather of its input over `model`, which DTensor would otherwise
      insert silently (under conv_data_fc_model the same gather collects the batch, whose rows
      the data-parallel convolutions left sharded on `model`); GatherOutput where the logits
      must reach the loss whole.

Every class keeps its stock layer's weights, names and get_config (checkpoints and exports
stay interchangeable with the plain model's). `VARIABLE_SPECS` (class attribute;
STOCK_VARIABLE_SPECS for stock layers) gives, in layouts.py's spec syntax, the layout each
variable needs when the layer's input channels are split on `model`; `SPLITS_OUTPUT` whether
the output is then split on channels (for merges, the instance's `split_output`). `mesh` (and
`split_output` for merges, `need_input_grad` for SplitConv2D) are set by
`dtensor_mesh.DTensorParallelism`'s converter right after construction, from the plan.
"""

from __future__ import annotations

from typing import ClassVar

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.split_conv import split_conv2d
from tf_multigpu.parallel.windows import (
    depthwise_conv2d,
    grouped_conv2d,
    taps,
    window_max,
    window_sum,
)

U = dtensor.UNSHARDED

_BN_SPECS = {"gamma": "model", "beta": "model", "moving_mean": "model", "moving_variance": "model"}
STOCK_VARIABLE_SPECS = {keras.layers.BatchNormalization: _BN_SPECS}


def activation_layout(x, mesh, split: bool) -> dtensor.Layout:
    """Batch-sharded, the last (channel/unit) dim split on `model` or whole."""
    return dtensor.Layout(["batch"] + [U] * (len(x.shape) - 2) + ["model" if split else U], mesh)


def relayout_activations(x, mesh, split: bool, name: str, split_before: bool | None = None):
    """x relaid out to batch-sharded with its last (channel/unit) dim split on `model` or
    whole, under the name scope the communication report counts. Split -> whole is an
    all-gather of x's size in the forward (its gradient is a local slice); whole -> split is
    a local slice in the forward and an all-gather of x's size in the backward (the gradient
    of a whole tensor must be whole); same layout is a no-op.

    `split_before` (x's layout in the placement plan, where the caller knows it) pins x to
    that layout first: DTensor's layout propagation otherwise carries the new layout upstream
    into x's producers, where a whole tensor's MaxPool or BatchNorm refuses a channel split
    (Xception: "EmitAllScatter was passed a desired_layout ... which was not more sharded than
    the original_layout", from the BatchNorm's tf.Mean two layers before the Add)."""
    layout = activation_layout(x, mesh, split)
    if split_before is not None and split_before != split:
        x = dtensor.relayout(x, activation_layout(x, mesh, split_before))

    @tf.custom_gradient
    def relayout(x):
        def grad(dy):   # back to x's layout, named too (whole -> split gathers here, backward).
            # dy is pinned to the output layout first: DTensor's layout propagation would
            # otherwise move the gather upstream, onto whichever op produced dy.
            with tf.name_scope(f"relayout/{name}/activation_gradients"):
                return dtensor.relayout_like(dtensor.relayout(dy, layout), x)
        return dtensor.relayout(x, layout), grad

    with tf.name_scope(f"relayout/{name}/activations"):
        return relayout(x)


class _OnMesh:
    """Mixin: `mesh`, set by dtensor_mesh's converter right after construction (these layers
    are only built for a DTensor mesh; without one the relayout fails, it is never skipped)."""

    mesh = None


def gather_model_axis(x, mesh, name):
    """Relayout x to batch-sharded, replicated on `model` (an all-gather of whatever dimension
    is sharded on `model`, channels or rows; a no-op if none is)."""
    with tf.name_scope(f"relayout/{name}/activations"):
        return dtensor.relayout(x, activation_layout(x, mesh, split=False))


class _Gathers(_OnMesh):
    """Mixin: gathers on `mesh` (see _OnMesh)."""

    def _gather(self, x):
        return gather_model_axis(x, self.mesh, self.name)


class GatherFirst(_Gathers):
    """Mixin for any layer that needs its whole input: gathers it, then runs the layer. A
    Conv2D or Dense after a split layer (a Dense split on units too: every unit needs every
    input), a Flatten of a channel-sharded map (NHWC flattening mixes channels into every
    position of the flat vector, so it cannot stay split on channels). A layer of several
    inputs (a user's layer called on a list) gets each of them whole."""

    def call(self, inputs, *args, **kwargs):
        return super().call(tf.nest.map_structure(self._gather, inputs), *args, **kwargs)


class GatherOutput(_Gathers):
    """Mixin for the model's last layer where its output (the logits) must reach the loss
    whole: gathers it after the layer runs."""

    def call(self, inputs, *args, **kwargs):   # `inputs` by name: Keras builds the layer from it
        return self._gather(super().call(inputs, *args, **kwargs))


class SplitConv2D(_Gathers, keras.layers.Conv2D):
    """Conv2D whose kernel DTensor may shard on output channels (the input is gathered)."""

    need_input_grad = True   # False for a first layer: no input gradient, no all-reduce

    def convolution_op(self, inputs, kernel):
        return split_conv2d(self._gather(inputs), kernel, self.strides, self.padding,
                            need_input_grad=self.need_input_grad, batch_groups=self.mesh.dim_size("batch"))


class SlicePool2D(keras.layers.MaxPooling2D):
    """Max pooling as the max over pool_size^2 strided slices: exact, layout-preserving; its
    backward keeps only its input and output (`windows.window_max`)."""

    def call(self, inputs):
        return window_max(inputs, self.pool_size, self.strides, self.padding)


# -- layers on split channels ----------------------------------------------------------
class _Nhwc:
    """Mixin: checks at construction (when the plan swaps the layer in, before any step)
    the geometry these layers implement: NHWC and, for convolutions, no dilation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.data_format != "channels_last":
            raise UsageError(f"layer {self.name}: split-aware layers need data_format='channels_last' (NHWC), "
                             f"not {self.data_format!r}: build the model channels-last")
        if tuple(getattr(self, "dilation_rate", (1, 1))) != (1, 1):
            raise UsageError(f"layer {self.name}: dilation_rate={tuple(self.dilation_rate)} on channel-split "
                             "activations is not supported: replicate the layer (keep its input whole)")


class SliceAvgPool2D(_Nhwc, keras.layers.AveragePooling2D):
    """Average pooling as the sum of pool_size^2 strided slices over the count of non-padded
    cells (Keras/TF 'same' semantics): exact, layout-preserving, no communication (in the eval
    step, 4 bytes per tap where it sums taps: `_tap_sum`)."""

    VARIABLE_SPECS: ClassVar[dict] = {}
    SPLITS_OUTPUT = True

    def call(self, inputs):
        (kh, kw), (sh, sw) = self.pool_size, self.strides
        if self.padding == "valid" and (kh, kw) == (sh, sw):   # tiling windows: a mean over a reshape
            oh, ow = inputs.shape[1] // kh, inputs.shape[2] // kw
            x = tf.reshape(inputs[:, :oh * kh, :ow * kw], [-1, oh, kh, ow, kw, inputs.shape[3]])
            return tf.reduce_mean(x, axis=[2, 4])
        total = window_sum(inputs, None, self.pool_size, self.strides, self.padding)
        if self.padding == "valid":
            return total / float(self.pool_size[0] * self.pool_size[1])
        # Cells per window that are not padding (fewer at the edges): a constant, as Keras'.
        ones = tf.ones((1, inputs.shape[1], inputs.shape[2], 1), total.dtype)
        return total / tf.add_n(taps(ones, self.pool_size, self.strides, "same"))


# -- merges --------------------------------------------------------------------------------
def _relayout_operands(layer, inputs, split: bool) -> list:
    """A merge's operands, each relaid out to one layout from the one the plan gave it."""
    before = layer.split_inputs or [None] * len(inputs)
    return [relayout_activations(x, layer.mesh, split, layer.name, b) for x, b in zip(inputs, before)]


class _OneLayout(_OnMesh):
    """Merge mixin: every operand is relaid out to the output's layout first (named), so
    DTensor never picks a silent relayout of its own. `split_output` (set by the plan):
    True keeps channels split (a whole operand is sliced locally, and its gradient
    all-gathered in the backward), False gathers split operands in the forward."""

    VARIABLE_SPECS: ClassVar[dict] = {}
    split_output = True
    split_inputs = None   # the operands' layouts in the plan (True: split), set with split_output

    def call(self, inputs):
        return super().call(_relayout_operands(self, inputs, self.split_output))


class SplitAdd(_OneLayout, keras.layers.Add):
    """Add (e.g. a ResNet shortcut) with its operands brought to one layout."""


class SplitSubtract(_OneLayout, keras.layers.Subtract):
    """Subtract with its operands brought to one layout."""


class SplitMultiply(_OneLayout, keras.layers.Multiply):
    """Multiply (e.g. squeeze-and-excitation) with its operands brought to one layout."""


class SplitAverage(_OneLayout, keras.layers.Average):
    """Average with its operands brought to one layout."""


class SplitMaximum(_OneLayout, keras.layers.Maximum):
    """Maximum with its operands brought to one layout."""


class SplitMinimum(_OneLayout, keras.layers.Minimum):
    """Minimum with its operands brought to one layout."""


class GatherConcatenate(_OnMesh, keras.layers.Concatenate):
    """Concatenate of channel-split operands. On the channel axis every operand is gathered
    first (named): concatenating the local shards would interleave the operands' channels
    (device d would hold [a_d, b_d], not a contiguous block of [a, b]). On another axis the
    operands only need one layout, kept split (`split_output`)."""

    VARIABLE_SPECS: ClassVar[dict] = {}
    split_output = True
    split_inputs = None

    def call(self, inputs):
        on_channels = self.axis % len(inputs[0].shape) == len(inputs[0].shape) - 1
        return super().call(_relayout_operands(self, inputs, self.split_output and not on_channels))


MERGES = {keras.layers.Add: SplitAdd, keras.layers.Subtract: SplitSubtract, keras.layers.Multiply: SplitMultiply,
          keras.layers.Average: SplitAverage, keras.layers.Maximum: SplitMaximum,
          keras.layers.Minimum: SplitMinimum, keras.layers.Concatenate: GatherConcatenate}


# -- convolutions on split channels ------------------------------------------------------
class SplitDepthwiseConv2D(_Nhwc, _OnMesh, keras.layers.DepthwiseConv2D):
    """DepthwiseConv2D on channel-split activations, kernel split on its channel dim:
    no communication (each device convolves its own channels) in the train step; the eval
    step's unrolled sum all-reduces 4 bytes per tap to keep its taps in order (`_tap_sum`)."""

    VARIABLE_SPECS: ClassVar[dict] = {"kernel": "-,-,model,-", "bias": "model"}
    SPLITS_OUTPUT = True

    def call(self, inputs):
        out = depthwise_conv2d(inputs, self.kernel, self.strides, self.padding)
        if self.use_bias:
            out = out + self.bias
        return self.activation(out) if self.activation is not None else out


class SplitSeparableConv2D(_Nhwc, _OnMesh, keras.layers.SeparableConv2D):
    """SeparableConv2D on channel-split activations: the depthwise part is local; the
    pointwise kernel is split on its input channels, so the 1x1 contraction over them ends
    in ONE all-reduce (sum) over `model` of the output ([B, oh, ow, filters], whole)."""

    VARIABLE_SPECS: ClassVar[dict] = {"depthwise_kernel": "-,-,model,-", "pointwise_kernel": "-,-,model,-"}
    SPLITS_OUTPUT = False   # the pointwise all-reduce leaves the output whole

    def call(self, inputs):
        return _separable(self, inputs, f"allreduce/{self.name}/activations")   # the one `model` collective


class FilterSplitSeparableConv2D(_Nhwc, _OnMesh, keras.layers.SeparableConv2D):
    """SeparableConv2D with its pointwise kernel split on its filters (filter_split, as a
    Conv2D's): its input is gathered whole first (named, as SplitConv2D's), the depthwise part
    runs whole on every device and each device computes its filters, so the output is split on
    channels. Backward, the depthwise output's gradient sums over the split filters: one
    all-reduce over `model` of [B, oh, ow, C * depth_multiplier]."""

    VARIABLE_SPECS: ClassVar[dict] = {"pointwise_kernel": "-,-,-,model", "bias": "model"}
    SPLITS_OUTPUT = True

    def call(self, inputs):
        return _separable(self, relayout_activations(inputs, self.mesh, False, self.name), f"split/{self.name}")


def _separable(layer, x, scope: str):
    """A SeparableConv2D's output: the depthwise convolution by window sums (DTensor refuses
    the stock op's backward), then the pointwise contraction as an einsum over channels."""
    out = depthwise_conv2d(x, layer.depthwise_kernel, layer.strides, layer.padding)
    with tf.name_scope(scope):
        out = tf.einsum("bhwc,cf->bhwf", out, tf.reshape(layer.pointwise_kernel, layer.pointwise_kernel.shape[2:]))
    if layer.use_bias:
        out = out + layer.bias
    return layer.activation(out) if layer.activation is not None else out


class SplitGroupedConv2D(_Nhwc, _OnMesh, keras.layers.Conv2D):
    """Conv2D with groups > 1 on channel-split activations, kernel split on its filters:
    no communication (the eval step: 4 bytes per tap, `_tap_sum`); the model axis must
    divide `groups` (checked when built)."""

    VARIABLE_SPECS: ClassVar[dict] = {"kernel": "-,-,-,model", "bias": "model"}
    SPLITS_OUTPUT = True

    def build(self, input_shape):
        m = self.mesh.dim_size("model") if self.mesh is not None and self.VARIABLE_SPECS else 1
        if self.groups % m:
            raise UsageError(f"layer {self.name}: groups={self.groups} does not divide by the {m} devices of the "
                             "model axis (each must hold whole groups): replicate the layer or change --mesh")
        super().build(input_shape)

    def convolution_op(self, inputs, kernel):
        return grouped_conv2d(inputs, kernel, self.groups, self.strides, self.padding)


class WholeGroupedConv2D(SplitGroupedConv2D):
    """Conv2D with groups > 1 on whole activations, its kernel whole, on a CPU mesh: the same
    window_sum. TensorFlow's CPU kernels have no gradient for a grouped convolution that a
    DTensor mesh runs (TF 2.21, oneDNN on: "Gradients for grouped convolutions are not
    supported on CPU. ... Computed input depth 24 doesn't match filter input depth 8"); a GPU
    mesh runs the stock layer (dtensor_mesh)."""

    VARIABLE_SPECS: ClassVar[dict] = {}
    SPLITS_OUTPUT = False


# Stock class -> its split-aware twin, for the placement plan (Conv2D only when groups > 1).
SPLIT_AWARE = {keras.layers.AveragePooling2D: SliceAvgPool2D, keras.layers.DepthwiseConv2D: SplitDepthwiseConv2D,
               keras.layers.SeparableConv2D: SplitSeparableConv2D, **MERGES}
