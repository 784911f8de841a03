"""Every private TensorFlow and Keras name the package uses, behind one door.

Each entry says why no public API does the job; `tests/test_compat.py` calls every one, so an
upgrade that moves or renames one fails there, loudly, and the next release touches this file
only. Nothing outside this module imports `keras.src`, `tensorflow.python` or reaches for an
underscore attribute of a TensorFlow or Keras object.
"""

from __future__ import annotations


def keras_name_scope_path() -> str:
    """Keras' current name-scope path (e.g. 'alexnet/conv1') inside a variable creator.

    A `tf.variable_creator_scope` creator is told a variable's name but not its Keras path,
    and layouts are rules on paths; Keras exposes the path only through its private scope stack.
    """
    from keras.src.backend.common.name_scope import current_path
    return current_path()


def inbound_layer_names(layer) -> list[list[str]]:
    """For each call of `layer` in a functional graph, the names of the layers producing its
    inputs, in the order of its inputs (InputLayers included).

    Keras 3 has no public accessor for a layer's inbound nodes (`layer.input` only says the
    tensor, not who made it); the placement plan needs the graph's edges.
    """
    out = []
    for node in layer._inbound_nodes:
        out.append([t._keras_history.operation.name for t in node.input_tensors])
    return out


def producer_name(tensor) -> str:
    """The name of the layer (or InputLayer) that produced a symbolic Keras tensor.

    Same reason as `inbound_layer_names`: KerasTensors carry their producer only in the
    private `_keras_history`.
    """
    return tensor._keras_history.operation.name
