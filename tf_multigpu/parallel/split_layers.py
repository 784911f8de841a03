"""Keras layers that run on channel-sharded activations under DTensor.

The layout policy swaps these in for the stock layers of a model (models stay plain Keras):

  SplitConv2D    Conv2D whose kernel is split on output channels: DTensor refuses a sharded
                 filter in Conv2D, so it runs `split_conv2d` (im2col + einsum, custom grad).
  SlicePool2D    MaxPooling2D from strided slices and tf.maximum, with its own gradient:
                 DTensor's MaxPool refuses channel-sharded inputs ("Only replicated or batch
                 parallel layout is supported"); this is exact and keeps the sharding.
  GatherFirst    mixin for Gather<Class>: any stock layer (Conv2D, Dense, Flatten,
                 Reshape...) preceded by one explicit all-gather of its input over the
                 `model` axis; dtensor_mesh makes the class from the plan's name. DTensor
                 would otherwise insert the same relayout silently; doing it here names it
                 (`relayout/<layer>/activations` in traces) and makes every activation
                 exchange of model parallelism deliberate and countable. Under
                 conv_data_fc_model the same gather collects the batch, whose rows the
                 data-parallel convolutions left sharded on `model`.

Each keeps its stock layer's weights and names, so checkpoints and exports are interchangeable
with the plain model's.
"""

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tf_multigpu.parallel.split_conv import split_conv2d
from tf_multigpu.parallel.split_layers_modern import activation_layout, window_max


def gather_model_axis(x, mesh, name):
    """Relayout x to batch-sharded, replicated on `model` (an all-gather of whatever dimension
    is sharded on `model`, channels or rows; a no-op if none is)."""
    with tf.name_scope(f"relayout/{name}/activations"):
        return dtensor.relayout(x, activation_layout(x, mesh, split=False))


class _Gathers:
    """Mixin: `mesh` to gather on, set by the layout policy right after construction (these
    layers exist only on a DTensor mesh; without one the gather fails, it is never skipped)."""

    mesh = None

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
    backward keeps only its input and output (`split_layers_modern.window_max`)."""

    def call(self, inputs):
        return window_max(inputs, self.pool_size, self.strides, self.padding)
