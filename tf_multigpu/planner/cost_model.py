"""Per-layer cost of a Keras model, alone and under each layout the package can run.

`analyze(model)` reads the model's graph once (`parallel/placement.model_graph`) and records,
per layer and per example: forward and backward FLOPs, parameter and activation sizes.
`placement(cost, layout, mesh_shape)` then says what each device does under a layout policy
on a `batch x model` mesh. It does not decide placement itself: it reads the one placement
plan (`parallel/placement.py`) that the DTensor converter, the communication report and the
memory estimate read too, and adds the FLOPs.

Counting conventions (the assumptions every number here rests on):
- A multiply-add is 2 FLOPs. Conv2D: 2*oh*ow*cout*kh*kw*cin/groups per example;
  DepthwiseConv2D: 2*oh*ow*cin*mult*kh*kw; Dense: 2*in*out per position. Bias adds,
  activations, batch normalisation, dropout, padding and flatten are not counted: they are
  memory traffic, a few percent of a ConvNet's step.
- Pooling costs one comparison per window element per output; its backward the same.
- Backward of a layer with weights = 2x forward (weight gradient + input gradient), except
  where nothing upstream has weights, which needs no input gradient (TensorFlow prunes it;
  our SplitConv2D skips it too): 1x.
- A filter-split conv (`split_layers.SplitConv2D`) runs the FLOPs of its einsum formulation
  (for a strided conv after space-to-depth, with the kernel zero-padded to a multiple of the
  stride).
- Memory per layer is `parallel/memory.py`'s (what each implementation keeps for the backward).
"""

from __future__ import annotations

import dataclasses
import math

import keras
import numpy as np

from tf_multigpu.parallel import memory
from tf_multigpu.parallel.layouts import BATCH_ON_MODEL
from tf_multigpu.parallel.placement import BYTES_PER_VALUE, CHANNELS, WHOLE, make_plan, model_graph


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
    out_rows: int = 0              # output rows (conv only): the split convolution's chunks are rows
    in_rows: int = 0               # rows of the stride-1 input it convolves (after space-to-depth)
    cls: type = keras.layers.Layer  # the Keras layer class
    input_grad: bool = True        # computes its input's gradient (something upstream has weights)

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
    nodes: tuple = ()          # the graph (parallel/placement.Node), for the placement plan

    @property
    def weights(self) -> dict:
        return {p: s for layer in self.layers for p, s in layer.weights.items()}

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def fwd_flops(self) -> float:
        return sum(layer.fwd_flops for layer in self.layers)


def analyze(model: keras.Model) -> ModelCost:
    """The per-example cost of every layer of a built Keras model."""
    nodes = model_graph(model)
    layers, upstream = [], {}
    for node in nodes:
        needs_dx = any(upstream[p] for p in node.inputs)
        upstream[node.name] = needs_dx or bool(node.trainable)
        if not node.inputs:   # a model input: no work of its own
            continue
        in_elems, out_elems, out_shape = node.in_elems, node.out_elems, node.out_shape
        in_shape = node.in_shapes[0] if node.in_shapes else ()
        kind, fwd, split_fwd, patches, rows = "other", 0.0, 0.0, 0, (0, 0)
        if issubclass(node.cls, (keras.layers.Conv2D, keras.layers.DepthwiseConv2D)):
            kind = "conv"
            kh, kw = node.config["kernel_size"]
            cin, cout = in_shape[-1], out_shape[-1]
            oh, ow = out_shape[0], out_shape[1]
            groups = node.config.get("groups", 1) if node.cls is not keras.layers.DepthwiseConv2D else cin
            fwd = 2.0 * oh * ow * cout * kh * kw * cin / groups
            s = node.config["strides"][0]
            taps = (math.ceil(kh / s) * s) * (math.ceil(kw / s) * s)   # space-to-depth pads the kernel
            patches = oh * ow * taps * cin
            rows = (oh, in_shape[0] if s == 1 else oh - 1 + math.ceil(kh / s))
            split_fwd = 2.0 * patches * cout
        elif issubclass(node.cls, keras.layers.SeparableConv2D):
            kind = "conv"
            kh, kw = node.config["kernel_size"]
            cin, cout = in_shape[-1], out_shape[-1]
            mult = node.config.get("depth_multiplier", 1)
            fwd = 2.0 * out_shape[0] * out_shape[1] * cin * mult * (kh * kw + cout)
        elif issubclass(node.cls, keras.layers.Dense):
            kind = "dense"
            fwd = 2.0 * (in_elems // in_shape[-1]) * in_shape[-1] * out_shape[-1]
        elif issubclass(node.cls, (keras.layers.MaxPooling2D, keras.layers.AveragePooling2D)):
            kind = "pool"
            fwd = float(out_elems * int(np.prod(node.config["pool_size"])))
        elif issubclass(node.cls, (keras.layers.GlobalMaxPooling2D, keras.layers.GlobalAveragePooling2D)):
            kind = "pool"
            fwd = float(in_elems)
        bwd = (2.0 * fwd if needs_dx else fwd) if kind in ("conv", "dense") else fwd
        layers.append(LayerCost(node.name, kind, in_elems, out_elems, fwd, bwd, dict(node.weights),
                                node.trainable, split_fwd, patches, out_rows=rows[0], in_rows=rows[1],
                                cls=node.cls, input_grad=needs_dx))
    return ModelCost(model.name, tuple(model.input_shape[1:]), int(model.output_shape[-1]), tuple(layers), nodes)


@dataclasses.dataclass(frozen=True)
class LayerPlacement:
    """What one device does for one layer under a layout (per example of its group batch)."""

    name: str
    role: str                  # "" (stock layer) or the split_layers class it becomes
    fwd_flops: float           # per example, this device's share
    bwd_flops: float
    split_conv_flops: float    # the part of fwd+bwd run by the im2col formulation
    param_bytes: int           # this device's shards
    grad_bytes: int            # this device's gradient shards (trainable weights)
    collectives: tuple = ()
    rows_split: bool = False   # runs on rows split over `model` (conv_data_fc_model, before the gather)
    input_grad: bool = True    # computes its input's gradient (a first layer does not)


def plan_for(cost: ModelCost, layout: str | None, mesh_shape: dict, overrides=()):
    """The placement plan of the analysed model under a built-in layout (None: replicated),
    amended by `overrides` (--layout_overrides, parsed; a replicated model takes none)."""
    mesh = mesh_shape if layout else {"batch": mesh_shape["batch"], "model": 1}
    return make_plan(None, layout or "", [], mesh, layout in BATCH_ON_MODEL, nodes=cost.nodes,
                     overrides=overrides if layout else ())


def placement(cost: ModelCost, layout: str | None, mesh_shape: dict, overrides=()) -> list[LayerPlacement]:
    """Per-layer work of one device: `layout=None` is a replicated model (single / data
    parallel), else a built-in policy name on the `batch x model` mesh `mesh_shape`.

    Raises UsageError when the layout cannot run the model (a split that does not divide, a
    weighted layer with no split-aware version receiving split activations).
    """
    plan = plan_for(cost, layout, mesh_shape, overrides)
    m = plan.mesh["model"]
    out = []
    for layer, placed in zip(cost.layers, [p for p in plan.layers if p.node.inputs]):
        split_work = placed.kernel_split or (placed.out_layout != WHOLE and not placed.gathers) or (
            placed.impl == "SplitSeparableConv2D" and placed.in_layouts[0] == CHANNELS)   # output whole, work split
        share = m if split_work else 1
        fwd, bwd, conv_flops = layer.fwd_flops / share, layer.bwd_flops / share, 0.0
        if placed.impl == "FilterSplitSeparableConv2D":   # its depthwise part runs whole on every device
            kh, kw = placed.node.config["kernel_size"]
            whole = kh * kw / (kh * kw + placed.node.config["filters"])   # the depthwise part's share of the work
            fwd, bwd = layer.fwd_flops * (whole + (1 - whole) / m), layer.bwd_flops * (whole + (1 - whole) / m)
        if placed.impl == "SplitConv2D":
            fwd = layer.split_fwd_flops / m
            bwd = fwd * (2.0 if placed.needs_input_grad else 1.0)
            conv_flops = fwd + bwd
        collectives = placed.collectives
        if placed is plan.layers[-1]:   # split logits gathered for the loss (the plan's step-level collective)
            collectives += tuple(c for c in plan.collectives if c.layer == "loss")
        out.append(LayerPlacement(
            layer.name, placed.impl, fwd, bwd, conv_flops,
            sum(plan.local_elems(p, s) for p, s in layer.weights.items()) * BYTES_PER_VALUE,
            sum(plan.local_elems(p, layer.weights[p]) for p in layer.trainable) * BYTES_PER_VALUE,
            collectives, placed.rows, placed.needs_input_grad))
    return out


def memory_per_device(cost: ModelCost, layout: str | None, mesh_shape: dict, global_batch: int,
                      overrides=()) -> dict:
    """`parallel/memory.py`'s bytes per device for the plan (one momentum slot per parameter,
    as the package's optimizer keeps)."""
    return memory.bytes_per_device(plan_for(cost, layout, mesh_shape, overrides), global_batch,
                                   slots_per_parameter=1)
