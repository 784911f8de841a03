"""Model factories a user might bring with --model=tests.user_models:NAME (used by tests)."""

import keras

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
