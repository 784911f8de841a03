"""Model registry: shapes and pinned parameter counts, user factories, clear errors."""

import pytest

from tf_multigpu.config.config import MODELS
from tf_multigpu.errors import UsageError
from tf_multigpu.models import REGISTRY, build_model


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
