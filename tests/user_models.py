"""Model factories a user might bring with --model=tests.user_models:NAME (used by tests)."""

import keras
import numpy as np

from tf_multigpu.compat import per_channel_layers

NOT_CALLABLE = 3


def tiny(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(num_classes)], name="tiny")


def wrong_classes(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(3)])


def small_convnet_no_dropout(input_shape, num_classes):
    """The default model without dropout (test_parity_bn_dropout shows that dropout is on in
    the parity steps by comparing with it)."""
    from tf_multigpu.models import small_convnet
    return small_convnet(input_shape, num_classes, dropout=0.0)


def spatial_dropout_convnet(input_shape, num_classes, noise=False):
    """Convolutions with SpatialDropout2D between them (whole feature maps dropped), and with
    noise=True a GaussianNoise layer, which draws its own noise on each device."""
    L = keras.layers
    layers = [keras.Input(input_shape), L.Conv2D(16, 3, padding="same", activation="relu", name="conv1"),
              L.SpatialDropout2D(0.5, name="spatial_drop"), L.Conv2D(16, 3, padding="same", activation="relu",
                                                                   name="conv2")]
    if noise:
        layers.append(L.GaussianNoise(0.1, name="noise"))
    layers += [L.GlobalAveragePooling2D(), L.Dense(num_classes, name="logits")]
    return keras.Sequential(layers, name="spatial_dropout_convnet")


def resnet50(input_shape, num_classes, **_):
    """keras.applications' ResNet-50 (random weights), logits out: a model we did not write."""
    return keras.applications.ResNet50(weights=None, input_shape=input_shape, classes=num_classes,
                                       classifier_activation=None)


def resnet50_first_blocks(input_shape, num_classes, **_):
    """keras.applications' ResNet-50 (random weights) cut after conv3_block1_out, with
    ResNet-50's head (global average pooling, `predictions`, logits out): its stem, stage conv2
    (a projection block and two identity blocks) and conv3's strided projection block -- 53 of
    its 177 layers, 0.6 M of its 23.6 M parameters, keras' own layers and names. The slow
    parity and profiling tests run it instead of the whole: each of its layers is placed as
    ResNet-50's layer of the same name, and every placement decision ResNet-50's plan makes
    occurs in it (test_placement.py)."""
    trunk = keras.applications.ResNet50(weights=None, include_top=False, input_shape=input_shape)
    x = keras.layers.GlobalAveragePooling2D(name="avg_pool")(trunk.get_layer("conv3_block1_out").output)
    return keras.Model(trunk.input, keras.layers.Dense(num_classes, name="predictions")(x),
                       name="resnet50_first_blocks")


def mobilenet_v2(input_shape, num_classes, **_):
    """keras.applications' MobileNetV2 (random weights), logits out: depthwise convolutions."""
    return keras.applications.MobileNetV2(weights=None, input_shape=input_shape, classes=num_classes,
                                          classifier_activation=None)


def mobilenet_v2_first_blocks(input_shape, num_classes, **_):
    """keras.applications' MobileNetV2 (random weights) cut after block_2_add, with a head of
    global average pooling and `predictions` (logits out): its stem, the unexpanded first block,
    a strided block behind zero padding and a residual block -- 27 of its 156 layers, keras' own
    layers and names. The slow parity and export tests run it instead of the whole: each of its
    layers is placed as MobileNetV2's layer of the same name, and every placement decision
    MobileNetV2's plan makes occurs in it (test_placement.py)."""
    trunk = keras.applications.MobileNetV2(weights=None, include_top=False, input_shape=input_shape)
    x = keras.layers.GlobalAveragePooling2D(name="global_average_pooling2d")(trunk.get_layer("block_2_add").output)
    return keras.Model(trunk.input, keras.layers.Dense(num_classes, name="predictions")(x),
                       name="mobilenet_v2_first_blocks")


def renamed_convnet(input_shape, num_classes, **_):
    """Conv2D, BatchNormalization, a residual Add, average pooling and no hidden Dense, with
    names nothing like conv, fc or dense: placement must go by what layers are."""
    L = keras.layers
    x = inputs = keras.Input(input_shape, name="pixels")
    x = L.Conv2D(16, 3, padding="same", name="alpha")(x)
    x = L.BatchNormalization(name="beta")(x)
    x = L.ReLU(name="gamma")(x)
    y = L.Conv2D(16, 3, padding="same", name="delta")(x)
    y = L.BatchNormalization(name="epsilon")(y)
    x = L.Add(name="zeta")([x, y])
    x = L.AveragePooling2D(2, name="eta")(x)
    x = L.GlobalAveragePooling2D(name="theta")(x)
    outputs = L.Dense(num_classes, name="iota")(x)
    return keras.Model(inputs, outputs, name="renamed")

def small_resnet_bn(input_shape, num_classes):
    """A small ResNet (stem, one residual block, global pooling) with BatchNormalization: the
    data-parallel BatchNorm parity model.

    No BatchNorm feeds another one: BatchNorm's input gradient sums to zero over the batch for
    each channel, so a beta upstream of a second BatchNorm gets a near-zero sum of large terms
    as gradient, whose relative rounding error (1.6e-5 measured, more than two one-device
    formulations of the moments differ by: 7.8e-6) would swamp what the parity tests measure.
    """
    layers = keras.layers
    images = keras.Input(input_shape)
    x = layers.Conv2D(16, 3, padding="same", use_bias=False)(images)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    y = layers.Conv2D(16, 3, padding="same", use_bias=False)(x)
    y = layers.ReLU()(layers.BatchNormalization()(y))
    y = layers.Conv2D(16, 3, padding="same")(y)
    x = layers.ReLU()(layers.Add()([x, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(images, layers.Dense(num_classes)(x), name="small_resnet_bn")



class _HostIdentity(keras.layers.Layer):
    """The identity through tf.py_function: runs anywhere but inside an XLA cluster."""

    def call(self, x):
        import tensorflow as tf
        y = tf.py_function(lambda t: t, [x], x.dtype)
        y.set_shape(x.shape)
        return y


def host_op_convnet(input_shape, num_classes):
    """A small ConvNet with an op XLA cannot compile (a Python function on the host)."""
    L = keras.layers
    return keras.Sequential([keras.Input(input_shape), L.Conv2D(8, 3, name="conv1"), _HostIdentity(name="host"),
                             L.GlobalAveragePooling2D(), L.Dense(num_classes, name="logits")], name="host_op_convnet")


def scoped_convnet(input_shape, num_classes, **_):
    """Layers built under keras.name_scope, as NASNet builds its cells: their variables'
    paths (`block/conv2/kernel`) are not what keras.models.clone_model gives the clone's."""
    L = keras.layers
    x = inputs = keras.Input(input_shape)
    x = L.Conv2D(8, 3, padding="same", name="conv1")(x)
    with keras.name_scope("block"):
        x = L.DepthwiseConv2D(3, padding="same", name="dw")(x)
        x = L.Conv2D(8, 3, padding="same", name="conv2")(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, L.Dense(num_classes, name="logits")(x), name="scoped_convnet")


class ScaledSum(keras.layers.Layer):
    """inputs[0] + inputs[1] * scale: a user's layer of two inputs (InceptionResNetV2's
    CustomScaleLayer)."""

    def __init__(self, scale, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}

    def call(self, inputs):
        return inputs[0] + inputs[1] * self.scale


def applications_idioms(input_shape, num_classes, **_):
    """What keras.applications models beyond ResNet and MobileNet do, each of which failed model
    parallelism before (a DTensor error, or a refusal): a Normalization built with constant mean
    and variance (EfficientNetV2, ConvNeXt: plain tensors, not variables), a LayerNormalization,
    keras.applications' LayerScale and bare keras.ops on channel-split activations (ConvNeXt's
    `x + LayerScale(...)`, MobileNetV3's hard-swish: refused), a stock MaxPooling2D on a whole
    tensor added to a channel-split shortcut (Xception: DTensor carried the split up into the
    pooling and the BatchNorm before it), and a user's layer of two inputs with the split one
    second or first (InceptionResNetV2's CustomScaleLayer: placed from its first input only)."""
    L = keras.layers
    x = inputs = keras.Input(input_shape)
    x = L.Normalization(mean=[0.5] * input_shape[-1], variance=[0.25] * input_shape[-1], name="normalize")(x)
    x = L.Conv2D(8, 3, padding="same", name="stem")(x)   # split on channels
    x = L.ReLU(name="stem_relu")(L.LayerNormalization(epsilon=1e-6, name="stem_ln")(x))
    layer_scale = per_channel_layers()[0](0.5, 8, name="layer_scale")   # its weight has no name
    x = x + layer_scale(L.DepthwiseConv2D(3, padding="same", name="depthwise")(x))   # a bare add
    x = x * keras.ops.relu6(x + 3.0) * np.float32(1 / 6)   # MobileNetV3's hard-swish, bare ops (a numpy scalar)
    shortcut = L.BatchNormalization(name="shortcut_bn")(L.Conv2D(16, 1, strides=2, use_bias=False,
                                                                 name="shortcut")(x))
    y = L.SeparableConv2D(16, 3, padding="same", use_bias=False, name="separable")(x)   # output whole
    y = L.BatchNormalization(name="separable_bn")(y)
    y = L.MaxPooling2D(3, strides=2, padding="same", name="pool")(y)
    x = L.Add(name="merge")([y, shortcut])   # whole + split
    a = L.Concatenate(name="concat")([L.Conv2D(8, 1, name="branch_a")(x), L.Conv2D(8, 1, name="branch_b")(x)])
    x = ScaledSum(0.2, name="scale_whole_first")([a, L.Conv2D(16, 3, padding="same", name="residual")(a)])
    x = ScaledSum(0.2, name="scale_split_first")([L.Conv2D(16, 1, name="mix")(x), x])
    x = L.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, L.Dense(num_classes, name="logits")(x), name="applications_idioms")


def layernorm_convnet(input_shape, num_classes, **_):
    """A LayerNormalization between two convolutions (ConvNeXt's stem): on filter_split its
    input is split on channels, its statistics per position are sums over the split."""
    L = keras.layers
    x = inputs = keras.Input(input_shape)
    x = L.Conv2D(8, 3, padding="same", name="conv1")(x)
    x = L.LayerNormalization(epsilon=1e-6, name="norm")(x)
    x = L.Conv2D(8, 3, padding="same", name="conv2")(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, L.Dense(num_classes, name="logits")(x), name="layernorm_convnet")


class Affine(keras.layers.Layer):
    """x * scale + shift with both weights made without a name (Keras numbers them)."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")
        self.shift = self.add_weight(shape=(input_shape[-1],), initializer="zeros")

    def call(self, x):
        return x * self.scale + self.shift


def adapted_unnamed_convnet(input_shape, num_classes, **_):
    """An adapted Normalization (its mean and variance derived from weights when built) and a
    user's layer with two unnamed weights, on the whole input, before split convolutions."""
    import numpy as np
    L = keras.layers
    norm = L.Normalization(name="normalize")
    norm.adapt(np.full((4, *input_shape), 5.0, "float32") + np.arange(4, dtype="float32").reshape(4, 1, 1, 1))
    x = inputs = keras.Input(input_shape)
    x = Affine(name="affine")(norm(x))
    x = L.GlobalAveragePooling2D(name="gap")(L.Conv2D(8, 3, padding="same", name="conv")(x))
    return keras.Model(inputs, L.Dense(num_classes, name="logits")(x), name="adapted_unnamed_convnet")


def separable_convnet(input_shape, num_classes, **_):
    """Xception's separable convolutions on filter_split: the first layer (a whole input, no
    input gradient) and every separable on a whole input split their pointwise kernel on
    filters (FilterSplitSeparableConv2D, output split); one on split channels stays row-split
    (SplitSeparableConv2D, output whole), so they alternate, as in Xception's middle flow,
    whose residual adds the whole output to the split shortcut. A depth multiplier of 2 and a
    stride of 2 on the last one (whole -> split)."""
    L = keras.layers
    x = inputs = keras.Input(input_shape)
    x = L.SeparableConv2D(8, 3, padding="same", name="sep_stem")(x)            # whole -> split, with a bias
    x = shortcut = L.ReLU(name="stem_relu")(L.BatchNormalization(name="stem_bn")(x))
    x = L.SeparableConv2D(8, 3, padding="same", use_bias=False, name="sep_row")(x)   # split -> whole
    x = L.ReLU(name="row_relu")(L.BatchNormalization(name="row_bn")(x))
    x = L.SeparableConv2D(8, 3, padding="same", use_bias=False, name="sep_column")(x)   # whole -> split
    x = L.BatchNormalization(name="column_bn")(x)
    x = L.SeparableConv2D(8, 3, padding="same", use_bias=False, name="sep_row2")(L.ReLU(name="column_relu")(x))
    x = L.Add(name="middle_add")([L.BatchNormalization(name="row2_bn")(x), shortcut])   # whole + split
    x = L.SeparableConv2D(16, 3, padding="same", name="sep_row3")(x)   # split -> whole, with a bias
    x = L.SeparableConv2D(16, 3, strides=2, depth_multiplier=2, name="sep_strided")(L.ReLU(name="row3_relu")(x))
    x = L.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, L.Dense(num_classes, name="logits")(x), name="separable_convnet")


def odd_stem_convnet(input_shape, num_classes, **_):
    """A stem of 5 filters, which no model axis of 2 or 4 divides (NASNetMobile's has 11):
    filter_split refuses it; --layout_overrides='.*stem/kernel=-,-,-,-' keeps it whole and
    lets the policy split the rest."""
    L = keras.layers
    x = inputs = keras.Input(input_shape)
    x = L.ReLU(name="stem_relu")(L.Conv2D(5, 3, padding="same", name="stem")(x))
    x = L.SeparableConv2D(8, 3, padding="same", name="sep")(x)   # whole input: split on filters
    x = L.Conv2D(8, 3, padding="same", name="conv")(L.BatchNormalization(name="sep_bn")(x))
    x = L.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, L.Dense(num_classes, name="logits")(x), name="odd_stem_convnet")


def batchnorm_variants(input_shape, num_classes, **_):
    """BatchNorms without scale (InceptionV3's conv2d_bn), without center, and without
    either, on split channels: on a mesh each runs as LeanBatchNormalization."""
    L = keras.layers
    x = inputs = keras.Input(input_shape)
    x = L.Conv2D(8, 3, padding="same", use_bias=False, name="c1")(x)
    x = L.ReLU(name="r1")(L.BatchNormalization(scale=False, name="bn_no_scale")(x))
    x = L.Conv2D(8, 3, padding="same", use_bias=False, name="c2")(x)
    x = L.ReLU(name="r2")(L.BatchNormalization(center=False, name="bn_no_center")(x))
    x = L.BatchNormalization(scale=False, center=False, name="bn_neither")(L.Conv2D(8, 3, padding="same", name="c3")(x))
    x = L.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, L.Dense(num_classes, name="logits")(x), name="batchnorm_variants")


def grouped_convnet(input_shape, num_classes, **_):
    """Grouped convolutions as ResNeXt and RegNet have them (1x1 -> grouped 3x3 -> 1x1 with a
    residual Add, and a strided grouped 3x3): SplitGroupedConv2D on a mesh, whose sums run tap
    by tap through window_sum; and a grouped stem on the whole image (WholeGroupedConv2D)."""
    L = keras.layers
    x = inp = keras.Input(input_shape)
    x = L.Conv2D(15, 3, padding="same", groups=3, use_bias=False, name="stem")(x)
    x = L.ReLU()(L.BatchNormalization(name="stem_bn")(L.Conv2D(16, 1, use_bias=False, name="stem_mix")(x)))
    y = L.Conv2D(16, 1, name="reduce")(x)
    y = L.Conv2D(16, 3, padding="same", groups=4, activation="relu", name="grouped")(y)
    x = L.Add(name="add")([x, L.Conv2D(16, 1, name="expand")(y)])
    x = L.Conv2D(32, 3, strides=2, groups=8, name="grouped_strided")(x)
    x = L.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inp, L.Dense(num_classes, name="predictions")(x), name="grouped_convnet")


def softmax_head_convnet(input_shape, num_classes, **_):
    """Probabilities out, as keras.applications' default head (classifier_activation="softmax"):
    trained on the logits before the softmax (tf_multigpu.models.strip_final_softmax)."""
    L = keras.layers
    return keras.Sequential([keras.Input(input_shape), L.Conv2D(16, 3, padding="same", activation="relu", name="conv1"),
                             L.Conv2D(16, 3, padding="same", activation="relu", name="conv2"),
                             L.GlobalAveragePooling2D(),
                             L.Dense(num_classes, activation="softmax", name="predictions")],
                            name="softmax_head_convnet")


class _Subclassed(keras.Model):
    """A subclassed model without get_config(): its call is Python, not a graph of layers."""

    def __init__(self, num_classes):
        super().__init__(name="subclassed_net")
        self.flatten, self.hidden = keras.layers.Flatten(), keras.layers.Dense(32, activation="relu")
        self.logits = keras.layers.Dense(num_classes)

    def call(self, x, training=False):
        return self.logits(self.hidden(self.flatten(x)))


def subclassed_net(input_shape, num_classes, **_):
    return _Subclassed(num_classes)


def sequential_without_input(input_shape, num_classes, **_):
    """A Sequential with no keras.Input: it has no output shape until it is called."""
    return keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(num_classes)], name="no_input")


def unnamed_dropout_convnet(input_shape, num_classes, **_):
    """A convnet whose Dropout has no name of its own: Keras numbers it per process."""
    L = keras.layers
    return keras.Sequential([keras.Input(input_shape), L.Conv2D(16, 3, padding="same", activation="relu", name="conv1"),
                             L.GlobalAveragePooling2D(name="pool"), L.Dropout(0.5),
                             L.Dense(num_classes, name="logits")])


def strided_one_pool_convnet(input_shape, num_classes, **_):
    """ResNet50V2's strided block: a MaxPooling2D(1, strides=2) shortcut (a window smaller than
    its stride, whose gradient has stride phases no tap reads) added to a strided convolution."""
    L = keras.layers
    x = inputs = keras.Input(input_shape)
    x = L.Conv2D(16, 3, padding="same", activation="relu", name="conv1")(x)
    shortcut = L.MaxPooling2D(1, strides=2, name="shortcut_pool")(x)
    x = L.Conv2D(16, 3, strides=2, padding="same", name="conv2")(x)
    x = L.Add(name="add")([shortcut, x])
    x = L.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inputs, L.Dense(num_classes, name="logits")(x))


class _Scale(keras.layers.Layer):
    """A user's layer whose __init__ takes no **kwargs: Keras' config of it holds 'trainable' and
    'dtype' beside its own argument, which its __init__ refuses."""

    def __init__(self, k):
        super().__init__()
        self.k = k

    def call(self, x):
        return x * self.k


def unconfigurable_layer_convnet(input_shape, num_classes, **_):
    """Trains on one device and data parallel; model parallelism, which makes each layer again
    from its config to place it, cannot make _Scale again."""
    images = keras.Input(input_shape)
    x = _Scale(2.0)(keras.layers.Conv2D(8, 3, activation="relu")(images))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(images, keras.layers.Dense(num_classes)(x))


def dilated_depthwise_convnet(input_shape, num_classes, **_):
    """A dilated depthwise convolution after a Conv2D: on channels the Conv2D's filter split
    leaves split, the split-aware depthwise layer refuses the dilation (its own message)."""
    images = keras.Input(input_shape)
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv")(images)
    x = keras.layers.DepthwiseConv2D(3, dilation_rate=2, padding="same", name="dilated")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(images, keras.layers.Dense(num_classes)(x))
