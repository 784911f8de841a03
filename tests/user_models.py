"""Model factories a user might bring with --model=tests.user_models:NAME (used by tests)."""

import keras

NOT_CALLABLE = 3


def tiny(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(num_classes)], name="tiny")


def wrong_classes(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(3)])
