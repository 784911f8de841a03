"""Model factories a user might bring with --model=tests.user_models:NAME (used by tests)."""

import keras

NOT_CALLABLE = 3


def tiny(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(num_classes)], name="tiny")


def wrong_classes(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(3)])


def small_convnet_no_dropout(input_shape, num_classes):
    """The default model without dropout: its updates do not depend on RNG draws, so runs on
    different meshes can be compared weight for weight."""
    from tf_multigpu.models import small_convnet
    return small_convnet(input_shape, num_classes, dropout=0.0)


def resnet50(input_shape, num_classes, **_):
    """keras.applications' ResNet-50 (random weights), logits out: a model we did not write."""
    return keras.applications.ResNet50(weights=None, input_shape=input_shape, classes=num_classes,
                                       classifier_activation=None)


def mobilenet_v2(input_shape, num_classes, **_):
    """keras.applications' MobileNetV2 (random weights), logits out: depthwise convolutions."""
    return keras.applications.MobileNetV2(weights=None, input_shape=input_shape, classes=num_classes,
                                          classifier_activation=None)


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
