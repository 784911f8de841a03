"""The fewest bytes each device must move per training step, from the model and its layout.

With B data-parallel groups and M devices per group (data: B = N, M = 1; model: B = 1, M = N):
- gradients: every parameter shard is summed over the g devices that share its layer's
  input rows (`par.gradient_group`: the B groups; all N devices for conv_data_fc_model's
  data-parallel convolutions); a ring all-reduce moves 2(g-1)/g of the shard's bytes per
  device (the bandwidth-optimal all-reduce).
- activations: where a layer needs the whole of an input that the layer before split over
  `model` (on channels or units, or on rows: conv_data_fc_model's batch before the first
  dense layer), the input is all-gathered ((M-1)/M of its bytes per device) and, backward,
  its gradient is reduce-scattered back to the shards ((M-1)/M again). A layer whose kernel
  is split but whose input is whole (e.g. the first split dense after a replicated flatten)
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
    per_group = getattr(par, "mesh_shape", {}).get("model", 1)
    out = {"gradients": 0.0, "parameters": 0.0, "activations": 0.0, "forward_activation_payload": 0}
    for layer in model.layers:
        group = par.gradient_group(layer.name)
        grads = sum(int(np.prod(par.local_shape(v))) * np.dtype(v.dtype).itemsize for v in layer.trainable_variables)
        out["gradients"] += grads * 2 * (group - 1) / group
    if per_group == 1:
        return out
    share = (per_group - 1) / per_group
    seen_weights = False
    for layer in model.layers:
        producer = _producer(layer)
        split_input = producer is not None and par.activation_split(producer) > 1
        # A weighted layer whose output is split (on units; rows are split only where the
        # input's are, which the first test below catches) has a split kernel.
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
