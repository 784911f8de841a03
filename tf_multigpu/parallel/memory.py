"""Bytes per device of parameters, gradients, optimizer slots and activations (RQ5).

Counted from each device's own shard shapes (DTensor's local shapes, the full shapes for
mirrored or single-device variables), so they show what splitting saves. Activations are the
outputs of every layer for one step's share of the batch, as kept for the backward pass:
a model-level estimate (the runtime may fuse or free some), the same for every strategy.
"""

import numpy as np


def bytes_per_device(model, optimizer, par) -> dict:
    """{"parameters", "gradients", "optimizer_slots", "activations", "total"} in bytes."""

    def nbytes(variable):
        return int(np.prod(par.local_shape(variable))) * np.dtype(variable.dtype).itemsize

    params = sum(nbytes(v) for v in model.weights)
    grads = sum(nbytes(v) for v in model.trainable_weights)
    slots = sum(nbytes(v) for v in optimizer.variables if len(v.shape))   # not the step counter
    activations = 0
    for layer in model.layers:
        per_example = int(np.prod(layer.output.shape[1:]))
        activations += par.replica_batch * per_example // par.activation_split(layer.name) * 4
    out = {"parameters": params, "gradients": grads, "optimizer_slots": slots, "activations": activations}
    out["total"] = sum(out.values())
    return out
