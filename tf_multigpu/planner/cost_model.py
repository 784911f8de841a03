"""Per-layer cost of a Keras model, alone and under each layout the package can run.

`analyze(model)` walks `model.layers` of a built Keras model once and records, per example:
forward and backward FLOPs, parameter bytes, activation bytes. `placement(cost, layout,
mesh_shape)` then says what each device does under a layout policy of `parallel/layouts.py`
on a `batch x model` mesh: which layers are split, their FLOPs and bytes per device, and the
activation collectives the model-parallel layers issue.

Counting conventions (the assumptions every number here rests on):
- A multiply-add is 2 FLOPs. Conv2D: 2*oh*ow*cout*kh*kw*cin per example; Dense: 2*in*out
  per position. Bias adds, activations (fused ReLU), dropout, padding and flatten are not
  counted: they are memory traffic, a few percent of a ConvNet's step.
- Pooling costs one comparison per window element per output; its backward the same.
- Backward of a conv or dense layer = 2x forward (weight gradient + input gradient), except
  the first layer with weights, which needs no input gradient (TensorFlow prunes it; our
  SplitConv2D skips it too): 1x.
- A filter-split conv (`split_layers.SplitConv2D`) runs im2col + einsum: its FLOPs are the
  einsum's (for a strided conv after space-to-depth, with the kernel zero-padded to a multiple
  of the stride), and it keeps its patch matrix for the backward (counted as activations).
- Activations kept for the backward = every layer's output, as `parallel/memory.py` counts
  them; float32 everywhere (4 bytes per value).

Which layers are split and where activations are gathered mirrors
`DTensorParallelism._converter` (`parallel/dtensor_mesh.py`); `tests/test_planner.py` checks
the two agree. Collectives per step of a model-parallel layer (counted in DTensor's expanded
graph, BUILD_NOTES.md):
- forward: one all-gather over `model` of a split input before a layer that needs it whole
  (SplitConv2D, GatherConv2D, GatherFlatten, GatherDense) and of split logits for the loss;
- backward: one all-reduce over `model` at the input's size for every layer whose kernel is
  split (its input gradient is a sum over the split output channels), none for the first.
  The gradient of an all-gather is a local slice: no traffic.
Under conv_data_fc_model (`BATCH_ON_MODEL`) the input's rows are split over `model` too:
layers run 1/M of the group batch until the first gathering layer, whose forward all-gather
collects the batch (and whose split kernel's input gradient is all-reduced backward, then
sliced back to rows: what DTensor's lowered graph does), and their weight gradients are
summed over the model axis as well (`LayerPlacement.rows_split`).
"""

from __future__ import annotations

import dataclasses
import math
import re

import keras
import numpy as np

from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.layouts import BATCH_ON_MODEL, POLICIES, assign_specs

BYTES_PER_VALUE = 4   # float32 parameters, gradients, slots and activations


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer's cost per example (FLOPs, element counts) and its weights."""

    name: str
    kind: str                  # conv | dense | pool | other
    in_elems: int              # values per example entering the layer
    out_elems: int             # values per example leaving it
    fwd_flops: float           # per example
    bwd_flops: float           # per example, input gradient included
    weights: dict              # Keras variable path -> shape
    trainable: tuple = ()      # paths of the trainable weights
    split_fwd_flops: float = 0.0   # the einsum formulation's FLOPs (conv only)
    patch_elems: int = 0           # im2col patch values per example (conv only)
    cls: type = keras.layers.Layer  # the Keras layer class

    @property
    def param_bytes(self) -> int:
        return sum(int(np.prod(s)) for s in self.weights.values()) * BYTES_PER_VALUE


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """The per-layer costs of one model, in layer order."""

    name: str
    input_shape: tuple
    num_classes: int
    layers: tuple

    @property
    def weights(self) -> dict:
        return {p: s for layer in self.layers for p, s in layer.weights.items()}

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def fwd_flops(self) -> float:
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def input_elems(self) -> int:
        return int(np.prod(self.input_shape))


def analyze(model: keras.Model) -> ModelCost:
    """The per-example cost of every layer of a built Keras model."""
    layers, seen_weights = [], False
    for layer in model.layers:
        in_shape = tuple(layer.input.shape[1:])
        out_shape = tuple(layer.output.shape[1:])
        in_elems, out_elems = int(np.prod(in_shape)), int(np.prod(out_shape))
        kind, fwd, split_fwd, patches = "other", 0.0, 0.0, 0
        if isinstance(layer, keras.layers.Conv2D):
            kind = "conv"
            kh, kw = layer.kernel_size
            cin, cout = in_shape[-1], out_shape[-1]
            oh, ow = out_shape[0], out_shape[1]
            fwd = 2.0 * oh * ow * cout * kh * kw * cin / layer.groups
            s = layer.strides[0]
            taps = (math.ceil(kh / s) * s) * (math.ceil(kw / s) * s)   # space-to-depth pads the kernel
            patches = oh * ow * taps * cin
            split_fwd = 2.0 * patches * cout
        elif isinstance(layer, keras.layers.Dense):
            kind = "dense"
            fwd = 2.0 * (in_elems // in_shape[-1]) * in_shape[-1] * out_shape[-1]
        elif isinstance(layer, (keras.layers.MaxPooling2D, keras.layers.AveragePooling2D)):
            kind = "pool"
            fwd = float(out_elems * int(np.prod(layer.pool_size)))
        elif isinstance(layer, (keras.layers.GlobalMaxPooling2D, keras.layers.GlobalAveragePooling2D)):
            kind = "pool"
            fwd = float(in_elems)
        if kind in ("conv", "dense"):
            bwd = fwd if not seen_weights else 2.0 * fwd   # the first layer needs no dx
        else:
            bwd = fwd
        weights = {v.path: tuple(v.shape) for v in layer.weights}
        trainable = tuple(v.path for v in layer.trainable_weights)
        layers.append(LayerCost(layer.name, kind, in_elems, out_elems, fwd, bwd, weights, trainable,
                                split_fwd, patches, type(layer)))
        seen_weights = seen_weights or bool(layer.weights)
    return ModelCost(model.name, tuple(model.input_shape[1:]), int(model.output_shape[-1]), tuple(layers))


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective per step: `op` over mesh axis `axis`, of a tensor of `elems_per_example`
    values per example of the group batch (activations), or `elems` values (gradients)."""

    op: str          # all_gather | all_reduce
    axis: str        # batch | model
    layer: str
    phase: str       # forward | backward
    elems_per_example: int = 0
    elems: int = 0


@dataclasses.dataclass(frozen=True)
class LayerPlacement:
    """What one device does for one layer under a layout (per example of its group batch)."""

    name: str
    role: str                  # "" (stock layer) or the split_layers class it becomes
    split_output: bool
    fwd_flops: float           # per example, this device's share
    bwd_flops: float
    split_conv_flops: float    # the part of fwd+bwd run by the im2col formulation
    param_bytes: int           # this device's shards
    grad_bytes: int            # this device's gradient shards (trainable weights)
    activation_bytes: int      # per example kept for the backward, this device's share
    collectives: tuple = ()
    rows_split: bool = False   # runs on rows split over `model` (conv_data_fc_model, before the gather)


def placement(cost: ModelCost, layout: str | None, mesh_shape: dict) -> list[LayerPlacement]:
    """Per-layer work of one device: `layout=None` is a replicated model (single / data
    parallel), else a built-in policy name on the `batch x model` mesh `mesh_shape`.

    Raises UsageError when the layout cannot run the model (a split that does not divide, a
    weighted layer with no split-aware version receiving split activations).
    """
    m = mesh_shape["model"] if layout else 1
    specs = assign_specs(cost.weights, POLICIES[layout], mesh_shape) if layout else {}

    def split(path):
        return "model" in specs.get(path, ())

    def local_bytes(paths):
        return sum(int(np.prod(cost.weights[p])) // (m if split(p) else 1) for p in paths) * BYTES_PER_VALUE

    out, split_input, seen_weights, rows = [], False, False, layout in BATCH_ON_MODEL
    for layer in cost.layers:
        kernel = next((p for p in layer.weights if re.search(r"/kernel$", p)), "")
        role, split_output, collectives = "", split_input, []
        # Mirrors DTensorParallelism._converter: the stock layer, or its split-aware twin.
        if layout and layer.cls is keras.layers.Conv2D:
            role = "SplitConv2D" if split(kernel) else ("GatherConv2D" if split_input else "")
            split_output = split(kernel)
        elif layout and layer.cls is keras.layers.Dense:
            role = "GatherDense" if (split_input or split(kernel)) else ""
            split_output = split(kernel)
        elif layout and layer.cls is keras.layers.MaxPooling2D and split_input:
            role, split_output = "SlicePool2D", True
        elif layout and layer.cls is keras.layers.Flatten and split_input:
            role, split_output = "GatherFlatten", False
        elif layer.weights and split_input:
            raise UsageError(f"layer {layer.name} ({layer.cls.__name__}) receives activations split on "
                             "'model' and has no split-aware version")
        gathers = role in ("SplitConv2D", "GatherConv2D", "GatherDense", "GatherFlatten")
        if (split_input or rows) and gathers:
            collectives.append(Collective("all_gather", "model", layer.name, "forward", layer.in_elems))
        kernel_split = bool(kernel) and split(kernel)
        if kernel_split and seen_weights:
            collectives.append(Collective("all_reduce", "model", layer.name, "backward", layer.in_elems))
        rows = rows and not gathers
        share = m if (kernel_split or role == "SlicePool2D" or rows) else 1
        fwd, bwd, conv_flops = layer.fwd_flops / share, layer.bwd_flops / share, 0.0
        if role == "SplitConv2D":
            fwd = layer.split_fwd_flops / m
            bwd = fwd * (2.0 if seen_weights else 1.0)
            conv_flops = fwd + bwd
        act = layer.out_elems // (m if split_output or rows else 1)
        if role == "SplitConv2D":
            act += layer.patch_elems   # the patch matrix, whole on every device of the group
        out.append(LayerPlacement(layer.name, role, split_output, fwd, bwd, conv_flops,
                                  local_bytes(layer.weights), local_bytes(layer.trainable),
                                  act * BYTES_PER_VALUE, tuple(collectives), rows))
        split_input = split_output
        seen_weights = seen_weights or bool(layer.weights)
    if split_input:   # split logits are gathered for the loss
        out[-1] = dataclasses.replace(out[-1], collectives=out[-1].collectives + (
            Collective("all_gather", "model", "loss", "forward", cost.num_classes),))
    return out
