"""Model registry: shapes and pinned parameter counts, user factories, clear errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_multigpu.config.config import MODELS
from tf_multigpu.errors import UsageError
from tf_multigpu.models import REGISTRY, build_model, strip_final_softmax


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


def _shared_softmax():
    """One Softmax layer called twice: the model's output is its second call."""
    inputs, softmax = keras.Input((4, 4, 2)), keras.layers.Softmax()
    x = softmax(keras.layers.Dense(6)(keras.layers.Flatten()(inputs)))
    return keras.Model(inputs, softmax(keras.layers.Dense(5)(x)))


def _ops_softmax():
    inputs = keras.Input((4, 4, 2))
    return keras.Model(inputs, keras.ops.softmax(keras.layers.Dense(5)(keras.layers.Flatten()(inputs))))


@pytest.fixture
def fresh_warnings(monkeypatch):
    """strip_final_softmax warns once per model name and process: each test starts afresh."""
    import tf_multigpu.models
    monkeypatch.setattr(tf_multigpu.models, "_warned", set())


@pytest.mark.parametrize("make", [
    lambda: _functional(keras.layers.Dense(5, activation="softmax", name="predictions")),
    lambda: _functional(keras.layers.Dense(5, activation=tf.nn.softmax)),
    lambda: _functional(keras.layers.Dense(5), keras.layers.Activation("softmax")),
    lambda: _functional(keras.layers.Dense(5), keras.layers.Softmax()),
    _shared_softmax,
    _ops_softmax,
    lambda: keras.Sequential([keras.Input((4, 4, 2)), keras.layers.Flatten(), keras.layers.Dense(5),
                              keras.layers.Softmax()]),
    lambda: keras.Sequential([keras.Input((4, 4, 2)), _functional(keras.layers.Dense(5, activation="softmax"))]),
    lambda: keras.applications.MobileNetV3Small(weights=None, input_shape=(32, 32, 3), classes=5,
                                                include_preprocessing=False),
], ids=["dense", "dense_tf_nn_softmax", "activation", "softmax_layer", "shared_softmax_layer", "ops_softmax",
        "sequential_softmax_layer", "nested_model", "mobilenet_v3_small"])
def test_a_final_softmax_is_removed_with_a_warning(make, fresh_warnings, caplog):
    """Whatever form the last softmax takes, the model then gives the logits whose softmax it
    gave before (training/step.py's loss takes logits)."""
    model = make()
    shape = (3, *model.input_shape[1:])
    images = np.random.RandomState(0).rand(*shape).astype("float32")
    probabilities = np.asarray(model(images))
    with caplog.at_level("WARNING"):
        logits = np.asarray(strip_final_softmax(model, "softmax_head")(images))
    assert np.allclose(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True), probabilities, atol=1e-6)
    assert not np.allclose(logits.sum(-1), 1.0, atol=1e-3)
    assert "applies softmax; training uses the logits before it" in caplog.text
    assert "classifier_activation=None" in caplog.text


class _SelfGated(keras.layers.Layer):
    """A custom layer whose softmax activation is not the last thing it does."""

    def __init__(self):
        super().__init__()
        self.activation = keras.activations.softmax

    def call(self, x):
        return x * self.activation(x)


def test_a_softmax_that_cannot_be_removed_is_kept_with_a_warning(fresh_warnings, caplog):
    model = _functional(keras.layers.Dense(5), _SelfGated())
    with caplog.at_level("WARNING"):
        assert strip_final_softmax(model, "gated") is model
    assert model.layers[-1].activation is keras.activations.softmax
    assert "cannot be removed there: training takes its probabilities for logits" in caplog.text


def test_a_model_with_logits_out_is_left_as_it_is(fresh_warnings, caplog):
    """A softmax inside the model, or a last layer with another activation, is not touched."""
    inner = keras.layers.Dense(6, activation="softmax")
    last = keras.layers.Dense(5, activation="relu")
    model = _functional(inner, last)
    with caplog.at_level("WARNING"):
        assert strip_final_softmax(model) is model
    assert inner.activation is keras.activations.softmax and last.activation is keras.activations.relu
    assert "softmax" not in caplog.text


def test_a_sequential_model_without_an_input_is_built():
    """Keras: "Sequential model 'no_input' has no defined output shape yet" (an AttributeError
    from build_model before): one image through it builds it, for every strategy."""
    from tf_multigpu.parallel.placement import make_plan
    model = build_model("tests.user_models:sequential_without_input", (8, 8, 1), 10)
    assert model.built and model.count_params() == 64 * 10 + 10
    assert make_plan(model, "filter_split", [], {"batch": 1, "model": 2}).layers


def test_a_subclassed_model_is_built_and_checked():
    """A subclassed model has no graph: build_model builds it by passing one image through it,
    which gives its output shape; model parallelism, which places a graph's layers, refuses it
    in one line."""
    from tf_multigpu.parallel.placement import make_plan
    model = build_model("tests.user_models:subclassed_net", (8, 8, 1), 10)
    assert model.built and model.count_params() == 64 * 32 + 32 + 32 * 10 + 10
    with pytest.raises(UsageError, match="subclassed_net is a subclassed keras.Model: .* use --strategy=data"):
        make_plan(model, "filter_split", [], {"batch": 1, "model": 2})
