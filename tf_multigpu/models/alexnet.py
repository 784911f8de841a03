"""AlexNet as trained in the paper (Krizhevsky et al. 2012), one tower.

conv 96 11x11/4, max pool 3/2, conv 256 5x5, max pool 3/2, conv 384, 384, 256 3x3, max pool
3/2, FC 4096, 4096, classes, with dropout 0.5 before each hidden FC layer. The original split
into two towers (grouped conv2/4/5) was a memory workaround; we keep one tower, as the paper
being reproduced does, so every layer is a full convolution that our strategies may split.
Local response normalisation is left out: it cannot be split across channel-sharded devices
and later AlexNet variants (e.g. torchvision's) drop it with no loss of accuracy. Conv1 pads
by 2 so a 224x224 input gives the paper's 55x55x96 map (a 227 input without padding would too).
"""

import keras
from keras import layers


def alexnet(input_shape, num_classes, dropout=0.5):
    """The 5 conv + 3 FC AlexNet; logits out. 224x224x3 input, 1000 classes: 62,378,344 params."""
    return _five_conv_three_fc(input_shape, num_classes, (96, 256), pad=2, dropout=dropout, name="alexnet")


def tf_cnn_benchmarks_alexnet():
    """tf_cnn_benchmarks' AlexNet (models/alexnet_model.py, 2017): the network the DGX-1
    figures were measured on, for its FLOPs and bytes only: 64 and 192 filters in conv1 and
    conv2, a 227x227 input without padding, 1001 classes (dropout has no FLOPs: left out)."""
    return _five_conv_three_fc((227, 227, 3), 1001, (64, 192), pad=0, dropout=None,
                               name="tf_cnn_benchmarks_alexnet")


def _five_conv_three_fc(input_shape, num_classes, conv12_filters, pad: int, dropout, name: str):
    """AlexNet's layer stack with conv1/conv2's filter counts, conv1's zero padding and the
    dropout before fc6 and fc7 (None: no Dropout layers) as the variants differ."""
    def drop(name):
        return [layers.Dropout(dropout, name=name)] if dropout is not None else []

    return keras.Sequential([
        keras.Input(shape=input_shape, name="images"),
        *([layers.ZeroPadding2D(pad, name="pad1")] if pad else []),
        layers.Conv2D(conv12_filters[0], 11, strides=4, activation="relu", name="conv1"),
        layers.MaxPooling2D(3, strides=2, name="pool1"),
        layers.Conv2D(conv12_filters[1], 5, padding="same", activation="relu", name="conv2"),
        layers.MaxPooling2D(3, strides=2, name="pool2"),
        layers.Conv2D(384, 3, padding="same", activation="relu", name="conv3"),
        layers.Conv2D(384, 3, padding="same", activation="relu", name="conv4"),
        layers.Conv2D(256, 3, padding="same", activation="relu", name="conv5"),
        layers.MaxPooling2D(3, strides=2, name="pool5"),
        layers.Flatten(name="flatten"),
        *drop("drop6"),
        layers.Dense(4096, activation="relu", name="fc6"),
        *drop("drop7"),
        layers.Dense(4096, activation="relu", name="fc7"),
        layers.Dense(num_classes, name="logits"),
    ], name=name)
