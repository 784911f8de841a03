"""Model factories by name: plain Keras 3 models that know nothing of devices.

A factory takes (input_shape, num_classes, **kwargs) and returns a keras.Model producing
logits. `--model=package.module:function` brings a user's own factory.

A model whose last layer applies softmax (keras.applications' default head) is trained on the
logits before it: the softmax is removed, with a warning. Keras' loss finds those logits itself
behind a Softmax op, but not behind mixed precision's float32 cast of the output (every
strategy), nor in float64 under DTensor: there it took the probabilities for logits, and the
update was 1e-3 of the right one (BUILD_NOTES.md, "Thirtieth session"). The export's
`probabilities` apply the softmax again.
"""

import importlib

import keras
from absl import logging

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
    return logits_out(model, name)


_SOFTMAX_NAMES = ("softmax", "softmax_v2")   # keras.activations.softmax, tf.nn.softmax
_warned: set[str] = set()


def logits_out(model, name: str = ""):
    """`model` with its final softmax removed (see the module's docstring), or as it is.

    A softmax as the output layer's activation (Dense, Conv, Activation) becomes linear in
    place; a final `keras.layers.Softmax` is dropped (Sequential) or cut off (functional). Only
    the layer that makes a functional or Sequential model's output is looked at."""
    outputs = getattr(model, "outputs", None) or []
    history = getattr(outputs[0], "_keras_history", None) if len(outputs) == 1 else None
    layer = history.operation if history is not None else None
    if layer is None:
        return model
    if getattr(getattr(layer, "activation", None), "__name__", None) in _SOFTMAX_NAMES:
        layer.activation = keras.activations.linear
    elif isinstance(layer, keras.layers.Softmax):
        if isinstance(model, keras.Sequential):
            model.pop()
        else:
            model = keras.Model(model.input, layer.input, name=model.name)
    else:
        return model
    if name not in _warned:
        _warned.add(name)
        logging.warning("--model=%s: its last layer %r applies softmax; training uses the logits before it, so it "
                        "is removed (build the model with logits out, e.g. classifier_activation=None, to silence "
                        "this)", name, layer.name)
    return model


def attr_name(name: str) -> str:
    """The function's name in a package.module:function --model value."""
    return name.partition(":")[2]


__all__ = ["REGISTRY", "get_factory", "build_model", "logits_out"]
