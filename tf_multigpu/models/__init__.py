"""Model factories by name: plain Keras 3 models that know nothing of devices.

A factory takes (input_shape, num_classes, **kwargs) and returns a keras.Model producing
logits. `--model=package.module:function` brings a user's own factory.
"""

import importlib

import keras

from tf_multigpu.errors import UsageError
from tf_multigpu.models.alexnet import alexnet
from tf_multigpu.models.small_convnet import small_convnet

REGISTRY = {"alexnet": alexnet, "small_convnet": small_convnet}


def get_factory(name: str):
    """The model factory for a --model value."""
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise UsageError(f"--model={name}: cannot import it ({e}); give package.module:function "
                             "of a function returning a Keras model") from None
        if not callable(factory):
            raise UsageError(f"--model={name} is not a function: give package.module:function")
        return factory
    raise UsageError(f"unknown --model={name!r}: choose one of {', '.join(sorted(REGISTRY))}, "
                     "or package.module:function")


def build_model(name: str, input_shape, num_classes, **kwargs):
    """Builds the named model; checks that it maps the input to `num_classes` logits.

    A user's factory (package.module:function) that raises or returns something other than a
    Keras model is a usage error naming it, not a traceback from deep inside the loop."""
    factory = get_factory(name)
    if name in REGISTRY:
        model = factory(tuple(input_shape), num_classes, **kwargs)
    else:
        try:
            model = factory(tuple(input_shape), num_classes, **kwargs)
        except Exception as e:  # noqa: BLE001  any failure of the user's code is theirs to fix
            reason = (str(e).strip().splitlines() or [""])[0][:200]
            raise UsageError(f"--model={name}: the factory raised {type(e).__name__}({reason}) when called as "
                             f"{attr_name(name)}(input_shape={tuple(input_shape)}, num_classes={num_classes}): "
                             "give a function that takes these and returns a keras.Model") from None
        if not isinstance(model, keras.Model):
            raise UsageError(f"--model={name} returned {type(model).__name__}, not a keras.Model: give a function "
                             "of (input_shape, num_classes) that returns a Keras model")
    out = tuple(model.output_shape)
    if out[-1] != num_classes:
        raise UsageError(f"--model={name} outputs shape {out}, not (batch, {num_classes}) logits")
    return model


def attr_name(name: str) -> str:
    """The function's name in a package.module:function --model value."""
    return name.partition(":")[2]


__all__ = ["REGISTRY", "get_factory", "build_model"]
