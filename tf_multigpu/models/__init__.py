"""Model factories by name: plain Keras 3 models that know nothing of devices.

A factory takes (input_shape, num_classes, **kwargs) and returns a keras.Model producing
logits. `--model=package.module:function` brings a user's own factory: a functional or
Sequential model for every strategy; a subclassed one (no graph of layers to place) for single
and data parallelism. One without an output shape yet (subclassed, or a Sequential without a
keras.Input) is built here by one image through it.

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

from tf_multigpu import compat
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
    """Builds the named model; checks that it maps the input to `num_classes` logits, and
    removes a final softmax (`strip_final_softmax`).

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
    try:
        out = tuple(model.output_shape)
    except AttributeError:   # a subclassed model, or a Sequential without an Input, before its first call:
        # one image through it builds it
        out = (None, *model(keras.ops.zeros((1, *input_shape))).shape[1:])
    if out[-1] != num_classes:
        raise UsageError(f"--model={name} outputs shape {out}, not (batch, {num_classes}) logits")
    return strip_final_softmax(model, name)


_SOFTMAX_NAMES = ("softmax", "softmax_v2")   # keras.activations/keras.ops.softmax; tf.nn.softmax
# Stock layers whose activation is the last thing their call does: a softmax there can be made
# linear. A custom layer's `activation` may be used otherwise, so it is only warned about.
_ACTIVATED = (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Conv1D, keras.layers.Conv2D,
              keras.layers.Conv3D, keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
              keras.layers.Conv3DTranspose, keras.layers.SeparableConv1D, keras.layers.SeparableConv2D,
              keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D, keras.layers.Activation)
_warned: set[str] = set()   # build_model runs several times per run (training, export, planner): warn once


def strip_final_softmax(model, name: str = ""):
    """`model` with its final softmax removed (see the module's docstring), or as it is.

    Looks at the operation that makes a functional or Sequential model's one output, and into
    a nested model there (keras.Sequential([keras.applications.MobileNetV2(...)])):
    - a stock layer with a softmax activation (Dense, Conv, Activation, ...) becomes linear,
      in place, at any depth;
    - a `keras.layers.Softmax` or a `keras.ops.softmax` call at the top level is cut off: the
      last layer is popped from a Sequential, a functional model is rebuilt up to that call's
      own input (not `layer.input`, which is a shared layer's first call's);
    - any other softmax (a custom layer's activation, a Softmax inside a nested model) is kept,
      with a warning that training will take its probabilities for logits."""
    name = name or model.name
    found = _final_softmax(model)
    if found is None:
        return model
    owner, operation, node = found
    if isinstance(operation, _ACTIVATED):
        operation.activation = keras.activations.linear
    elif owner is model and _is_softmax_op(operation):
        if isinstance(model, keras.Sequential):
            model.pop()
        else:
            model = keras.Model(model.input, node.input_tensors[0], name=model.name)
    else:
        _warn_once(name, f"--model={name}: its last operation {operation.name!r} applies softmax, which cannot be "
                         "removed there: training takes its probabilities for logits (wrong under mixed precision "
                         "and DTensor float64); build the model with logits out, e.g. classifier_activation=None")
        return model
    _warn_once(name, f"--model={name}: its last layer {operation.name!r} applies softmax; training uses the logits "
                     "before it, so it is removed (build the model with logits out, e.g. "
                     "classifier_activation=None, to silence this)")
    return model


def _final_softmax(model):
    """(the model that holds it, the operation, its call's node) for a softmax that makes the
    model's one output, looking into nested models; None if the output is not a softmax."""
    outputs = getattr(model, "outputs", None) or []
    produced = compat.producer(outputs[0]) if len(outputs) == 1 else None
    if produced is None:
        return None
    operation, node = produced
    if isinstance(operation, keras.Model):
        return _final_softmax(operation)
    activation = getattr(getattr(operation, "activation", None), "__name__", None)
    if activation in _SOFTMAX_NAMES or _is_softmax_op(operation):
        return model, operation, node
    return None


def _is_softmax_op(operation) -> bool:
    """A keras.layers.Softmax, or the operation keras.ops.softmax adds to a functional graph."""
    return isinstance(operation, keras.layers.Softmax) or type(operation).__name__ == "Softmax"


def _warn_once(name: str, message: str):
    if name not in _warned:
        _warned.add(name)
        logging.warning(message)


def attr_name(name: str) -> str:
    """The function's name in a package.module:function --model value."""
    return name.partition(":")[2]


__all__ = ["REGISTRY", "get_factory", "build_model", "strip_final_softmax"]
