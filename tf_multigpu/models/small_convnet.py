"""A small ConvNet for small images (the default model, sized for 8x8 digits).

Three 3x3 convolutions (32, 64, 128 filters), max pooling, and two dense layers. Layer names
are explicit so layout rules and checkpoints can name them.
"""

import keras
from keras import layers


def small_convnet(input_shape, num_classes, dropout=0.25):
    """conv32-conv64-pool-conv128-pool-fc256-fc(classes); logits out."""
    return keras.Sequential([
        keras.Input(shape=input_shape, name="images"),
        layers.Conv2D(32, 3, padding="same", activation="relu", name="conv1"),
        layers.Conv2D(64, 3, padding="same", activation="relu", name="conv2"),
        layers.MaxPooling2D(2, name="pool2"),
        layers.Conv2D(128, 3, padding="same", activation="relu", name="conv3"),
        layers.MaxPooling2D(2, name="pool3"),
        layers.Flatten(name="flatten"),
        layers.Dense(256, activation="relu", name="fc1"),
        layers.Dropout(dropout, name="drop1"),
        layers.Dense(num_classes, name="logits"),
    ], name="small_convnet")
