"""Model factories by name: plain Keras 3 models that know nothing of devices.

A factory takes (input_shape, num_classes, **kwargs) and returns a keras.Model producing
logits. `--model=package.module:function` brings a user's own factory.
"""

import importlib

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
    """Builds the named model; checks that it maps the input to `num_classes` logits."""
    model = get_factory(name)(tuple(input_shape), num_classes, **kwargs)
    out = tuple(model.output_shape)
    if out[-1] != num_classes:
        raise UsageError(f"--model={name} outputs shape {out}, not (batch, {num_classes}) logits")
    return model


__all__ = ["REGISTRY", "get_factory", "build_model"]
