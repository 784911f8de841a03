"""The fewest bytes each device must move per training step, from the model and its layout.

With B data-parallel groups and M devices per group (data: B = N, M = 1; model: B = 1, M = N):
- gradients: every parameter shard is summed over the B groups; a ring all-reduce moves
  2(B-1)/B of the shard's bytes per device (the bandwidth-optimal all-reduce).
- activations: where a layer needs the whole of an input that the layer before split over
  `model`, the input is all-gathered ((M-1)/M of its bytes per device) and, backward, its
  gradient is reduce-scattered back to the shards ((M-1)/M again). A layer whose kernel is
  split but whose input is whole (e.g. the first split dense after a replicated flatten)
  sends back a partial input gradient to be all-reduced (2(M-1)/M), except the first layer
  with weights, which needs no input gradient.
- parameters: 0 (the built-in layouts never move weights).
"""

from __future__ import annotations

import numpy as np


def minimum_bytes(model, par) -> dict:
    """{"gradients", "parameters", "activations", "forward_activation_payload"} per device.

    `forward_activation_payload` is the size of the activations gathered forward (before
    any algorithm factor): what the measured forward all-gathers must add up to.
    """
    groups = par.num_replicas
    per_group = getattr(par, "mesh_shape", {}).get("model", 1)
    grads = sum(int(np.prod(par.local_shape(v))) * np.dtype(v.dtype).itemsize for v in model.trainable_variables)
    out = {"gradients": grads * 2 * (groups - 1) / groups, "parameters": 0.0, "activations": 0.0,
           "forward_activation_payload": 0}
    if per_group == 1:
        return out
    share = (per_group - 1) / per_group
    seen_weights = False
    for layer in model.layers:
        producer = _producer(layer)
        split_input = producer is not None and par.activation_split(producer) > 1
        split_kernel = bool(layer.weights) and par.activation_split(layer.name) > 1
        input_bytes = par.replica_batch * int(np.prod(layer.input.shape[1:])) * 4 if producer else 0
        if split_input and hasattr(layer, "_gather"):   # a split_layers layer that gathers its input
            out["activations"] += 2 * share * input_bytes   # all-gather forward, reduce-scatter backward
            out["forward_activation_payload"] += input_bytes
        elif split_kernel and not split_input and seen_weights:
            out["activations"] += 2 * share * input_bytes   # partial input gradients, all-reduced
        seen_weights = seen_weights or bool(layer.weights)
    return out


def _producer(layer) -> str | None:
    """Name of the layer whose output feeds `layer` (None for the model's input)."""
    try:
        operation = layer.input._keras_history[0]
    except (AttributeError, ValueError, IndexError):
        return None
    return None if type(operation).__name__ == "InputLayer" else operation.name
