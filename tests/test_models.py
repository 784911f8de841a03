"""Model registry: shapes and pinned parameter counts, user factories, clear errors."""

import keras
import numpy as np
import pytest

from tf_multigpu.config.config import MODELS
from tf_multigpu.errors import UsageError
from tf_multigpu.models import REGISTRY, build_model, logits_out


def test_alexnet_matches_the_paper():
    model = build_model("alexnet", (224, 224, 3), 1000)
    assert model.count_params() == 62_378_344
    shapes = {layer.name: tuple(layer.output.shape[1:]) for layer in model.layers}
    assert shapes["conv1"] == (55, 55, 96)
    assert shapes["conv2"] == (27, 27, 256)
    assert shapes["conv5"] == (13, 13, 256)
    assert shapes["flatten"] == (9216,)
    assert shapes["logits"] == (1000,)


def test_small_convnet_on_digits():
    model = build_model("small_convnet", (8, 8, 1), 10)
    assert model.count_params() == 226_570
    assert tuple(model.output_shape) == (None, 10)


def test_user_factory_by_import_path():
    model = build_model("tests.user_models:tiny", (8, 8, 1), 10)
    assert model.name == "tiny"


@pytest.mark.parametrize("name, needle", [
    ("resnet", "unknown --model='resnet': choose one of alexnet, small_convnet"),
    ("no.such.module:fn", "cannot import it"),
    ("tests.user_models:missing", "cannot import it"),
    ("tests.user_models:NOT_CALLABLE", "is not a function"),
    ("tests.user_models:wrong_classes", "not (batch, 10) logits"),
    ("os:getcwd", "--model=os:getcwd: the factory raised TypeError(posix.getcwd() takes no arguments"),
    ("builtins:slice", "--model=builtins:slice returned slice, not a keras.Model"),
])
def test_bad_model_names(name, needle):
    with pytest.raises(UsageError, match=None) as e:
        build_model(name, (8, 8, 1), 10)
    assert needle in str(e.value)


def test_the_config_knows_the_registrys_names():
    """The config refuses an unknown --model before TensorFlow starts, from its own list."""
    assert sorted(MODELS) == sorted(REGISTRY)


def _functional(*head):
    inputs = keras.Input((4, 4, 2))
    x = keras.layers.Flatten()(inputs)
    for layer in head:
        x = layer(x)
    return keras.Model(inputs, x)


@pytest.mark.parametrize("make", [
    lambda: _functional(keras.layers.Dense(5, activation="softmax", name="predictions")),
    lambda: _functional(keras.layers.Dense(5), keras.layers.Activation("softmax")),
    lambda: _functional(keras.layers.Dense(5), keras.layers.Softmax()),
    lambda: keras.Sequential([keras.Input((4, 4, 2)), keras.layers.Flatten(), keras.layers.Dense(5),
                              keras.layers.Softmax()]),
], ids=["dense_softmax", "activation_softmax", "softmax_layer", "sequential_softmax_layer"])
def test_a_final_softmax_is_removed_with_a_warning(make, caplog):
    """Whatever form the last softmax takes, the model then gives the logits whose softmax it
    gave before (training/step.py's loss takes logits)."""
    model = make()
    images = np.random.RandomState(0).rand(3, 4, 4, 2).astype("float32")
    probabilities = np.asarray(model(images))
    with caplog.at_level("WARNING"):
        logits = np.asarray(logits_out(model, f"softmax_head_{id(model)}")(images))
    assert np.allclose(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True), probabilities, atol=1e-6)
    assert not np.allclose(logits.sum(-1), 1.0, atol=1e-3)
    assert "applies softmax" in caplog.text and "classifier_activation=None" in caplog.text


def test_a_model_with_logits_out_is_left_as_it_is():
    """A softmax inside the model, or a last layer with another activation, is not touched."""
    inner = keras.layers.Dense(6, activation="softmax")
    last = keras.layers.Dense(5, activation="relu")
    model = _functional(inner, last)
    assert logits_out(model) is model
    assert inner.activation is keras.activations.softmax and last.activation is keras.activations.relu
