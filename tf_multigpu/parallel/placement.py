"""One placement plan: how every tensor of a model is laid out on a `batch x model` mesh,
which implementation every layer runs, and what each layer communicates.

It is computed once, from the model's functional graph (branches, merges and nested
functional or Sequential models included), and everything that needs placement reads it:
the DTensor converter (which layer class to swap in, which layout each variable gets), the
planner's cost model, the communication report's analytic minimum and the memory estimate.
No other module walks the layers to decide placement.

Layouts of activations. Every activation is sharded on its rows over the mesh's `batch` axis
(the data-parallel groups); on the `model` axis it is one of
  WHOLE     replicated on the M devices of a group;
  CHANNELS  its last dimension (conv channels, dense units) split M ways;
  ROWS      its rows split M ways too (conv_data_fc_model: the input batch over `model`).

Implementations. A layer runs its stock Keras class, or a split-aware twin from
`split_layers` (same weights, names and config):
  SplitConv2D      kernel split on output channels; gathers a split input first
  Gather<Layer>    any layer that needs its whole input after a split one: one named
                   all-gather over `model`, then the stock layer (GatherConcatenate for a
                   concatenation of split channels)
  SlicePool2D, SliceAvgPool2D, SplitDepthwiseConv2D, SplitGroupedConv2D
                   run on CHANNELS without communication (`split_layers.py`); their
                   variables follow the channels (each class's VARIABLE_SPECS)
  SplitSeparableConv2D
                   on split channels: depthwise part local, pointwise partial sums
                   all-reduced (output whole)
  FilterSplitSeparableConv2D
                   filter_split's SeparableConv2D on a whole input (or where a rule splits
                   its pointwise kernel on filters): the depthwise part whole on every
                   device, the pointwise kernel split on filters (output split). Together
                   with the above, separable convolutions alternate column- and row-split,
                   as Megatron's MLP does: no forward gather between the two
  Split<Merge>     Add, Multiply... of a split and a whole operand: the whole one is sliced
                   (its gradient gathered back)
  stock            BatchNormalization (per-channel statistics over the global batch: its
                   variables follow the channels), LayerNormalization over the channels
                   (statistics per position, all-reduced over `model`; gamma and beta follow
                   the channels), elementwise layers and elementwise bare keras.ops
                   (`x + 3.0`, on operands split alike), keras.applications' LayerScale (its
                   gamma follows the channels), global pooling, and anything on WHOLE/ROWS.

Communication per step (what DTensor runs; BUILD_NOTES.md has the lowered graphs):
  forward   one all-gather over `model` of a split input before a layer that needs it whole,
            and of split logits for the loss;
  backward  one all-reduce over `model`, at the input's size, for every layer whose kernel is
            split on its output (its input gradient sums over the split channels), except
            where nothing upstream has weights (no input gradient is computed); for a
            FilterSplitSeparableConv2D, of its depthwise output's gradient instead (the sum
            over the split filters), needed by the depthwise kernel's gradient too;
  statistics LayerNormalization on split channels all-reduces two values per position
            forward (mean, variance) and, where an input gradient is computed, two backward;
            SplitSeparableConv2D all-reduces its pointwise partial sums (the output) forward;
  gradients every trainable variable's gradient is summed over the devices that saw
            different rows: the B groups, times M for layers on ROWS.

Optimizer state. With --shard_optimizer_state (B > 1 batch groups on a split layout), each
momentum buffer is sharded over `batch` too (`slot_spec`, ZeRO stage 1): on its first
dimension that is not split on `model` and divides by B. A group would otherwise keep the
same momentum as the other B - 1.
The update then runs on the slot's shard: the gradient's sum over `batch` arrives as that
shard (a reduce-scatter), and the new velocity is all-gathered back into the variable, which
together move what the all-reduce did (with NCCL; elsewhere DTensor reduce-scatters by an
all-reduce and a slice, so the all-gather is extra). Variables no dimension of which divides
(biases split on `model`) keep their variable's layout.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import keras
import numpy as np

from tf_multigpu.compat import elementwise_op, inbound_layer_names, op_call_shapes, per_channel_layers, producer_name
from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.layouts import UNSPLIT, NotDividing, assign_specs, keep_whole, whole_rule
from tf_multigpu.parallel.split_layers import (
    MERGES,
    SPLIT_AWARE,
    STOCK_VARIABLE_SPECS,
    FilterSplitSeparableConv2D,
    SplitGroupedConv2D,
)

WHOLE, CHANNELS, ROWS = "whole", "channels", "rows"
BYTES_PER_VALUE = 4   # float32 activations, parameters, gradients and slots
MAX_REFUSED = 16      # make_plan names at most this many layers that do not divide, then stops

L = keras.layers
# Layers that act on each value (or each channel, or each pixel) alone: a channel split
# passes through them untouched, with no communication.
ELEMENTWISE = (L.Activation, L.ReLU, L.LeakyReLU, L.ELU, L.Rescaling, L.Dropout, L.SpatialDropout2D,
               L.GaussianNoise, L.GaussianDropout, L.ZeroPadding2D, L.Cropping2D, L.Identity,
               L.BatchNormalization, L.GlobalAveragePooling2D, L.GlobalMaxPooling2D)
_NOT_PER_CHANNEL_ACTIVATIONS = ("softmax", "log_softmax")
# Stock layers whose backward DTensor refuses on every layout ("'tf.AvgPoolGrad' op does not
# implement layout propagation", the same for DepthwiseConv2dNativeBackpropInput/Filter): on a
# mesh they always run their split-aware twin, which is exact on whole inputs too.
DTENSOR_REFUSES = (L.AveragePooling2D, L.DepthwiseConv2D, L.SeparableConv2D)


@dataclasses.dataclass(frozen=True)
class Node:
    """One layer of the (flattened) functional graph, with what placement needs of it."""

    name: str
    cls: type                  # the stock Keras class
    inputs: tuple              # producer names; "" for a model input
    in_shapes: tuple           # per input, per example
    out_shape: tuple           # per example
    weights: dict              # variable path -> shape
    trainable: tuple           # paths of the trainable weights
    config: dict = dataclasses.field(compare=False, repr=False, default_factory=dict)

    @property
    def in_elems(self) -> int:
        return sum(int(np.prod(s)) for s in self.in_shapes)

    @property
    def out_elems(self) -> int:
        return int(np.prod(self.out_shape))

    def weight(self, name: str) -> str:
        """The path of this layer's variable `name` (kernel, bias, gamma...), or ""."""
        return next((p for p in self.weights if p.rsplit("/", 1)[-1] == name), "")

    @property
    def depthwise_elems(self) -> int:
        """A SeparableConv2D's depthwise output per example, [oh, ow, C * depth_multiplier]
        (what its pointwise kernel reads); 0 for other layers."""
        if not issubclass(self.cls, L.SeparableConv2D):
            return 0
        return int(np.prod(self.out_shape[:-1])) * self.in_shapes[0][-1] * self.config.get("depth_multiplier", 1)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective per step over mesh axis `axis`, of `elems_per_example` values per example
    of the group batch (activations)."""

    op: str          # all_gather | all_reduce
    axis: str        # batch | model
    layer: str
    phase: str       # forward | backward
    elems_per_example: int = 0


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What one layer does on every device of a group."""

    node: Node
    impl: str                  # "" for the stock class, else a split_layers class name
    in_layouts: tuple
    out_layout: str
    gathers: bool              # gathers a split input whole first
    kernel_split: bool         # its kernel is split on outputs: its input gradient is all-reduced
    needs_input_grad: bool     # something upstream has weights
    collectives: tuple = ()
    merge_layout: str = ""     # merges: the layout every operand is brought to
    new_gather: bool = False   # its gather makes a new tensor (an earlier consumer of the same
                               # split tensor did not gather it already; DTensor merges the two)

    @property
    def name(self) -> str:
        return self.node.name

    def collective_elems(self, op: str, phase: str = "") -> int:
        """Values per example this layer's `op` collectives (of `phase`, or both) move."""
        return sum(c.elems_per_example for c in self.collectives if c.op == op and phase in ("", c.phase))

    @property
    def rows(self) -> bool:
        """Runs on rows split over `model` (conv_data_fc_model before the batch gather)."""
        return self.out_layout == ROWS


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    """The placement of every layer and variable of one model on one mesh."""

    model: str
    mesh: dict                 # {"batch": B, "model": M}
    layout: str                # the policy name ("" for a replicated model)
    layers: tuple              # LayerPlan, in topological order
    specs: dict                # variable path -> spec (one mesh axis or '-' per dimension)
    output_layout: str         # the logits' layout (CHANNELS: gathered for the loss)
    num_classes: int
    shard_slots: bool = False  # optimizer slots sharded over `batch` too (see the docstring)

    def __getitem__(self, name: str) -> LayerPlan:
        return self._by_name[name]

    @functools.cached_property
    def _by_name(self) -> dict:   # built once: the converter looks up every layer
        return {p.name: p for p in self.layers}

    def split_on_model(self, path: str) -> bool:
        return "model" in self.specs.get(path, ())

    def local_elems(self, path: str, shape) -> int:
        """Values of variable `path` that one device holds."""
        return self._local(self.specs.get(path, ()), shape)

    def slot_spec(self, path: str, shape) -> tuple:
        """The spec of the optimizer slot of variable `path`: the variable's, with `batch` on its
        first unsplit dimension that divides by B where slots are sharded."""
        spec = list(self.specs.get(path) or [UNSPLIT] * len(shape))
        if self.shard_slots:
            for d, (axis, n) in enumerate(zip(spec, shape)):
                if axis == UNSPLIT and n % self.mesh["batch"] == 0:
                    spec[d] = "batch"
                    break
        return tuple(spec)

    def local_slot_elems(self, path: str, shape) -> int:
        """Values of variable `path`'s optimizer slot that one device holds."""
        return self._local(self.slot_spec(path, shape), shape)

    def _local(self, spec, shape) -> int:
        return int(np.prod(shape)) // int(np.prod([self.mesh[a] for a in spec if a != UNSPLIT]))

    def gradient_group(self, layer: LayerPlan) -> int:
        """Devices whose gradients of the layer's weights are summed."""
        return self.mesh["batch"] * (self.mesh["model"] if layer.rows else 1)

    def share(self, layout: str) -> int:
        """How many ways a tensor of this layout is split on the model axis."""
        return 1 if layout == WHOLE else self.mesh["model"]

    @property
    def collectives(self) -> tuple:
        """Every activation collective of a step, the loss's logits gather included."""
        out = tuple(c for p in self.layers for c in p.collectives)
        if self.output_layout == CHANNELS:
            out += (Collective("all_gather", "model", "loss", "forward", self.num_classes),)
        return out


def model_graph(model: keras.Model) -> tuple:
    """The model's layers as Nodes in topological order; nested models are flattened (their
    inputs wired to the outer producers, their name standing for the layer of their output)."""
    nodes, alias = [], {}

    def walk(m, outer_inputs):
        if not hasattr(m, "inputs"):   # a subclassed model: its call is Python, not a graph of layers
            raise UsageError(f"{m.name} is a subclassed keras.Model: model and hybrid parallelism place the "
                             "layers of a functional or Sequential model's graph; build it with the functional "
                             "API, or use --strategy=data")
        for k, tensor in enumerate(m.inputs):
            name = producer_name(tensor)
            if outer_inputs is None:
                nodes.append(Node(name, L.InputLayer, (), (), tuple(tensor.shape[1:]), {}, ()))
            else:
                alias[name] = outer_inputs[k]
        # a functional model's layers and the bare ops between them (`x + 3.0`, `keras.ops.*`), in
        # `layers`' order; a Sequential has layers only (and no `operations`)
        for layer in getattr(m, "operations", m.layers):
            if isinstance(layer, L.InputLayer):
                continue
            calls = inbound_layer_names(layer)
            if len(calls) > 1:
                raise UsageError(f"layer {layer.name} ({type(layer).__name__}) is called {len(calls)} times: model "
                                 "parallelism places each layer once; give each call its own layer")
            producers = tuple(alias.get(p, p) for p in (calls[0] if calls else ()))
            if isinstance(layer, keras.Model):
                if len(layer.outputs) != 1:
                    raise UsageError(f"nested model {layer.name} has {len(layer.outputs)} outputs: model "
                                     "parallelism flattens nested models with one output")
                walk(layer, producers)
                alias[layer.name] = alias.get(producer_name(layer.outputs[0]), producer_name(layer.outputs[0]))
                continue
            if not isinstance(layer, keras.layers.Layer):   # a bare op: no weights, one call
                in_shapes, out_shape = op_call_shapes(layer)
                nodes.append(Node(layer.name, type(layer), producers, in_shapes, out_shape, {}, (),
                                  {"elementwise": elementwise_op(layer)}))
                continue
            ins = layer.input if isinstance(layer.input, (list, tuple)) else [layer.input]
            nodes.append(Node(layer.name, type(layer), producers,
                              tuple(tuple(t.shape[1:]) for t in ins), tuple(layer.output.shape[1:]),
                              {v.path: tuple(v.shape) for v in layer.weights},
                              tuple(v.path for v in layer.trainable_weights), layer.get_config()))

    walk(model, None)
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise UsageError(f"{model.name} has layers of the same name in nested models: give them unique names")
    return tuple(nodes)


def _is(node: Node, *classes) -> bool:
    """Exactly one of the stock classes: a user's subclass may change what `call` does, so it
    is never swapped for a split-aware twin."""
    return node.cls in classes


def _classifier(nodes: tuple) -> str:
    """The Dense layer producing the logits (through weightless elementwise layers only), or ""."""
    by_name = {n.name: n for n in nodes}
    node = nodes[-1]
    while node.cls is not L.Dense and issubclass(node.cls, ELEMENTWISE) and not node.weights and node.inputs:
        node = by_name[node.inputs[0]]
    return node.name if node.cls is L.Dense else ""


def policy_rules(nodes: tuple, policy: str, model_name: str, skip=frozenset()) -> list:
    """A built-in policy as exact-path rules, chosen by what each layer is (never by its name):
    filter_split splits every Conv2D on output channels (grouped ones by whole groups) and every
    Dense on units; fc_only and conv_data_fc_model every Dense. The classifier is split where
    its class count divides the model axis (rules ending in "?") and replicated where not.
    Variables in `skip` (placed by --layout_overrides) get no rule, nor does the bias of a
    kernel in it."""
    from tf_multigpu.parallel.layouts import SPLIT_TYPES
    types = tuple(getattr(L, t) for t in SPLIT_TYPES[policy])
    classifier = _classifier(nodes)
    rules = []
    for node in nodes:
        if not _is(node, *types) or node.config.get("groups", 1) > 1:   # grouped convs follow their input
            continue
        kernel, bias = node.weight("kernel"), node.weight("bias")
        if kernel in skip:
            continue
        optional = "?" if node.name == classifier else ""
        rank = len(node.weights[kernel])
        rules.append((re.escape(kernel), ",".join([UNSPLIT] * (rank - 1) + ["model"]) + optional))
        if bias and bias not in skip:
            rules.append((re.escape(bias), "model" + optional))
    if not rules and not skip:
        raise UsageError(f"--layout={policy} splits {' and '.join(SPLIT_TYPES[policy])} layers and {model_name} has "
                         f"none: use --layout=filter_split, or name variables with --layout_rules")
    return rules


def make_plan(model: keras.Model, layout: str, rules, mesh: dict, batch_on_model: bool = False,
              nodes: tuple | None = None, shard_slots: bool = False, overrides=()) -> PlacementPlan:
    """The placement of `model` (or of its graph `nodes`) under a built-in `layout` (or user
    `rules`, [(path regex, spec)]) on `mesh`; layout "" is a replicated model (single / data).
    `overrides` (rules too) amend the layout: the variables they match are theirs, the layout
    places the rest (a layer whose kernel they match gets no rule of the layout's at all).
    `shard_slots`: the optimizer's slots are sharded over `batch` too (`PlacementPlan.slot_spec`).

    Raises UsageError, naming the layer and the fix, where the model cannot be placed. Under a
    built-in layout, every layer that does not divide by the model axis is named in one
    refusal, with the one --layout_overrides value that keeps them all whole (NASNetMobile
    has ten such layers: before, each run named the next one).
    """
    nodes = nodes if nodes is not None else model_graph(model)
    name = model.name if model is not None else "the model"
    if rules or not layout:
        return _place(nodes, name, layout, rules, mesh, batch_on_model, shard_slots, tuple(overrides))
    refused, plan, later = [], None, None   # refused: NotDividing, in the order the plan meets them
    while plan is None and len(refused) < MAX_REFUSED:
        # Keep each refused layer whole and plan again: what follows it may change (a layer
        # after a whole one gets a whole input), so the next refusal is found by planning.
        # Each pass is a whole plan: the cap bounds the work where most layers do not divide
        # (NASNet on model:3), and a value with more rules than that is no fix anyway.
        kept = tuple(whole_rule(e.path, e.rank) for e in refused)
        try:
            plan = _place(nodes, name, layout, rules, mesh, batch_on_model, shard_slots, tuple(overrides) + kept)
        except NotDividing as e:
            if any(e.path == r.path for r in refused):
                raise
            refused.append(e)
        except UsageError as e:
            if not refused:
                raise
            later = e   # the layers that do not divide come first: this may be their consequence
            break
    if not refused:
        return plan
    m, paths = mesh["model"], [p for n in nodes for p in n.weights]
    short = {e.path: _shortest_suffix(e.path, paths) for e in refused}
    shown = refused if len(refused) <= 4 else refused[:3]
    whats = "; ".join(e.what.replace(e.path, short[e.path]) for e in shown)
    whats += f"; and {len(refused) - 3} more" if len(refused) > 4 else ""
    layers, them = ("1 layer does", "it") if len(refused) == 1 else (f"{len(refused)} layers do", "them")
    if plan is None and later is None:
        raise UsageError(f"at least {len(refused)} layers do not divide by the {m} devices of mesh axis 'model' "
                         f"({whats}): change --mesh or the layout")
    if later is not None:
        raise UsageError(f"{layers} not divide by the {m} devices of mesh axis 'model' ({whats}), and with "
                         f"{them} kept whole the plan fails: {later}") from None
    if not any("model" in spec for spec in plan.specs.values()):
        raise UsageError(f"--layout={layout} can split none of {name}'s layers over the {m} devices of mesh axis "
                         f"'model' ({whats}): change --mesh or the layout")
    if len(refused) == 1 and not overrides:
        raise refused[0]
    # the value replaces the user's --layout_overrides, so it carries theirs too
    fix = ";".join([f"{regex}={spec}" for regex, spec in overrides]
                   + [f"{'.*/' if short[e.path] != e.path else ''}{whole_rule(short[e.path], e.rank)[0]}="
                      f"{whole_rule(e.path, e.rank)[1]}" for e in refused])
    raise UsageError(f"{layers} not divide by the {m} devices of mesh axis 'model' ({whats}): "
                     f"change --mesh or the layout, or keep {them} whole: "
                     f"--layout_overrides='{fix}'")


def _shortest_suffix(path: str, paths: list) -> str:
    """The fewest trailing components of `path` (at least the layer's and the variable's) that
    no other variable's path ends with: `.*/<suffix>` then names it alone, and a refusal naming
    ten of NASNet's deeply nested variables stays readable."""
    parts = path.split("/")
    for k in range(2, len(parts)):
        suffix = "/".join(parts[-k:])
        if not any(p != path and (p == suffix or p.endswith("/" + suffix)) for p in paths):
            return suffix
    return path


def _place(nodes, name, layout, rules, mesh, batch_on_model, shard_slots, overrides) -> PlacementPlan:
    """make_plan, for one set of overrides."""
    weights = {p: s for n in nodes for p, s in n.weights.items()}
    overridden = {p for p in weights if any(re.fullmatch(regex, p) for regex, _ in overrides)}
    if not layout and not rules:
        specs = {}
    elif rules:
        specs = assign_specs(weights, rules, mesh)
    else:
        rest = {p: s for p, s in weights.items() if p not in overridden}
        specs = assign_specs(rest, policy_rules(nodes, layout, name, skip=overridden), mesh, hint_whole=True)
        specs.update(assign_specs({p: weights[p] for p in overridden}, overrides, mesh, flag="--layout_overrides rule"))
    specs = {p: list(s) for p, s in specs.items()}
    walker = _Walker(nodes, specs, mesh, batch_on_model, split_separables=layout == "filter_split" and not rules,
                     fixed=overridden)
    layers = tuple(walker.place(n) for n in nodes)
    out = layers[-1].out_layout
    if out == ROWS:
        raise UsageError(f"{name}'s logits are still split on rows at the end: conv_data_fc_model needs a Dense "
                         "layer to gather the batch; use --layout=filter_split or fc_only")
    # Only a split model replicated over several batch groups can shard its optimizer state
    # over them (--shard_optimizer_state).
    shard_slots = shard_slots and bool(layout or rules) and mesh["batch"] > 1
    return PlacementPlan(name, dict(mesh), layout if not rules else "rules", layers, specs, out,
                         int(nodes[-1].out_shape[-1]), shard_slots)


class _Walker:
    """Decides each layer's implementation and output layout from its inputs' layouts."""

    def __init__(self, nodes, specs, mesh, batch_on_model, split_separables=False, fixed=frozenset()):
        self.specs, self.mesh, self.batch_on_model = specs, mesh, batch_on_model
        self.split_separables = split_separables   # filter_split: SeparableConv2D on whole inputs too
        self.fixed = fixed   # variables --layout_overrides placed: the policy does not split them
        self.m = mesh["model"]
        self.layout, self.upstream_weights = {}, {}
        self.gathered = set()   # split tensors some layer gathered already

    def split(self, path: str) -> bool:
        return "model" in self.specs.get(path, ())

    def follow(self, node: Node, specs: dict):
        """Give `node`'s variables the specs of its split-aware implementation (`specs`: name
        -> spec text, e.g. {"kernel": "-,-,model,-"}): they follow a channel-split input,
        unless a rule already placed them. An override that places one otherwise is refused:
        a follower cannot be kept whole on split channels."""
        for var, text in specs.items():
            path = node.weight(var)
            spec = text.split(",")
            if path in self.fixed and self.specs[path] != spec:
                raise UsageError(f"--layout_overrides places {path} as {','.join(self.specs[path])}, but it follows "
                                 f"its layer's input, whose channels are split: it is {text} there; drop that "
                                 "override (to keep the layer whole, keep the layer before it whole)")
            if not path or self.split(path):
                continue
            shape = node.weights[path]
            for dim, (size, axis) in enumerate(zip(shape, spec)):
                if axis == "model" and size % self.m:
                    raise UsageError(f"{path} dimension {dim} ({size}) follows channels split over {self.m} devices "
                                     "but does not divide: change --mesh")
            self.specs[path] = spec

    def place(self, node: Node) -> LayerPlan:
        ins = tuple(self.layout[p] for p in node.inputs)
        needs_dx = any(self.upstream_weights[p] for p in node.inputs)
        impl, out, gathers, kernel_split, merge = self._decide(node, ins)
        self.layout[node.name] = out
        self.upstream_weights[node.name] = needs_dx or bool(node.trainable)
        collectives = []
        split_in = [(p, s) for p, s, lay in zip(node.inputs, node.in_shapes, ins) if lay != WHOLE]
        # Two layers gathering the same split tensor (a residual block's first conv and its
        # projection shortcut) share one all-gather: DTensor's lowering merges the identical relayouts.
        new = [(p, s) for p, s in split_in if p not in self.gathered] if gathers else []
        if new:
            self.gathered.update(p for p, _ in new)
            elems = sum(int(np.prod(s)) for _, s in new)
            collectives.append(Collective("all_gather", "model", node.name, "forward", elems))
        if impl == "FilterSplitSeparableConv2D":
            # the depthwise output's gradient sums over the split filters: the input's gradient
            # and the (whole) depthwise kernel's both need it
            if needs_dx or node.weight("depthwise_kernel") in node.trainable:
                collectives.append(Collective("all_reduce", "model", node.name, "backward", node.depthwise_elems))
        elif kernel_split and needs_dx:
            collectives.append(Collective("all_reduce", "model", node.name, "backward", node.in_elems))
        if merge == CHANNELS:   # whole operands were sliced: their gradients are gathered back
            whole = [s for s, lay in zip(node.in_shapes, ins) if lay == WHOLE]
            if whole and needs_dx:
                elems = sum(int(np.prod(s)) for s in whole)
                collectives.append(Collective("all_gather", "model", node.name, "backward", elems))
        if _is(node, L.LayerNormalization) and CHANNELS in ins:
            # Per position (example, row, column): the mean and variance over the split channels
            # forward; backward, the input gradient's two sums over them (gamma's and beta's
            # gradients stay local). Measured in DTensor's lowered step: four all-reduces of
            # [B, H, W, 1].
            positions = node.out_elems // node.out_shape[-1]
            collectives.append(Collective("all_reduce", "model", node.name, "forward", 2 * positions))
            if needs_dx:
                collectives.append(Collective("all_reduce", "model", node.name, "backward", 2 * positions))
        if impl == "SplitSeparableConv2D" and ins[0] == CHANNELS:   # pointwise over split channels: partial sums
            collectives.append(Collective("all_reduce", "model", node.name, "forward", node.out_elems))
        return LayerPlan(node, impl, ins, out, gathers and bool(split_in), kernel_split, needs_dx,
                         tuple(collectives), merge, bool(new))

    def _decide(self, node: Node, ins: tuple):
        """(impl, output layout, gathers, kernel split, merge layout) for one layer."""
        if not node.inputs:   # a model input
            return "", (ROWS if self.batch_on_model else WHOLE), False, False, ""
        x = ins[0]
        kernel = node.weight("kernel")
        if _is(node, *MERGES):   # Add, ..., Minimum and Concatenate
            return self._merge(node, ins)
        if _is(node, L.Conv2D):
            if node.config.get("groups", 1) > 1:
                return self._grouped(node, x)
            if self.split(kernel):
                return "SplitConv2D", CHANNELS, True, True, ""
            return ("GatherConv2D", WHOLE, True, False, "") if x == CHANNELS else ("", x, False, False, "")
        if _is(node, L.Dense):
            if self.split(kernel):
                return "GatherDense", CHANNELS, True, True, ""
            return ("GatherDense", WHOLE, True, False, "") if x == CHANNELS else ("", x, False, False, "")
        if _is(node, L.SeparableConv2D) and self._splits_filters(node, x):
            self._refuse_split(node, "splits its pointwise kernel on filters, which runs its depthwise part whole on "
                               "every device", [node.weight("depthwise_kernel")])
            return "FilterSplitSeparableConv2D", CHANNELS, True, True, ""
        if node.cls in DTENSOR_REFUSES:   # on any layout: DTensor has no layout propagation for their backward
            impl = SPLIT_AWARE[node.cls]
            if x != CHANNELS:
                self._refuse_split(node, "receives activations not split on channels")
                return impl.__name__, x, False, False, ""
            self.follow(node, impl.VARIABLE_SPECS)
            return impl.__name__, (CHANNELS if impl.SPLITS_OUTPUT else WHOLE), False, False, ""
        if CHANNELS in ins and not issubclass(node.cls, keras.layers.Layer):   # any operand, not only the first
            # Elementwise on operands split alike (MobileNetV3's `x + 3.0`, ConvNeXt's
            # `inputs + x`): each device computes its channels, as for an Add layer.
            if node.config.get("elementwise") and set(ins) == {CHANNELS} and all(
                    s[-1] == node.out_shape[-1] for s in node.in_shapes):
                return "", CHANNELS, False, False, ""
            return self._unplaceable(node, "is a bare op between layers (keras.ops) other than an elementwise one on "
                                     "operands split alike, which model parallelism cannot place on split channels "
                                     "(wrapped in a layer, it would run gathered)")
        if CHANNELS not in ins:   # on whole or row-split activations every stock layer runs as it is
            self._refuse_split(node, "has no split-aware version")
            return "", x, False, False, ""
        # -- an input is split on channels (the only input, but for a user's layer of several:
        # those are gathered below, whichever of their inputs is split) -------------------
        if _is(node, L.BatchNormalization):
            if node.config.get("axis") not in (-1, len(node.out_shape), [-1], [len(node.out_shape)]):
                return self._unplaceable(node, f"normalises axis {node.config.get('axis')}, not the split channels")
            self.follow(node, STOCK_VARIABLE_SPECS[L.BatchNormalization])
            return "", CHANNELS, False, False, ""
        if _is(node, L.LayerNormalization):
            if node.config.get("axis") not in (-1, len(node.out_shape), [-1], [len(node.out_shape)]):
                return self._unplaceable(node, f"normalises axis {node.config.get('axis')}, not the split channels "
                                         "alone")
            # Its mean and variance over the channels are sums over the split: DTensor
            # all-reduces them (below); gamma and beta follow the channels.
            self.follow(node, {"gamma": "model", "beta": "model"})
            return "", CHANNELS, False, False, ""
        if _is(node, *per_channel_layers()):   # their weights scale the channels: split with them
            self.follow(node, {path.rsplit("/", 1)[-1]: "model" for path in node.weights})
            return "", CHANNELS, False, False, ""
        if _is(node, L.MaxPooling2D):
            return "SlicePool2D", CHANNELS, False, False, ""
        if _is(node, *ELEMENTWISE) and not (node.cls is L.Activation and
                                             node.config.get("activation") in _NOT_PER_CHANNEL_ACTIVATIONS):
            return "", CHANNELS, False, False, ""
        if node.weights:
            return self._unplaceable(node, "has weights and no split-aware version")
        return f"Gather{node.cls.__name__}", WHOLE, True, False, ""   # weightless: gather, then run it

    def _splits_filters(self, node: Node, x: str) -> bool:
        """Whether a SeparableConv2D splits its pointwise kernel on its filters: where a rule
        says so, or under filter_split where its input is whole. On split channels filter_split
        keeps it row-split (SplitSeparableConv2D: no gather before it, its output whole), so
        the two alternate. Sets the kernel's and bias's specs where it does."""
        pointwise = node.weight("pointwise_kernel")
        if self.specs.get(pointwise, [UNSPLIT])[-1] == "model":
            return True
        if not (self.split_separables and x == WHOLE) or self.split(pointwise) or pointwise in self.fixed:
            return False
        filters = node.weights[pointwise][-1]
        if filters % self.m:
            what = f"{pointwise} dimension 3 ({filters})"
            raise NotDividing(f"{what} does not divide by the {self.m} devices of mesh axis 'model': change --mesh "
                              f"or the layout, or {keep_whole(pointwise, 4)}", pointwise, 4, what)
        for var, text in FilterSplitSeparableConv2D.VARIABLE_SPECS.items():   # pointwise kernel and bias
            path = node.weight(var)
            if path and path not in self.fixed:
                self.specs[path] = text.split(",")
        return True

    def _grouped(self, node: Node, x: str):
        """A grouped Conv2D follows its input: on split channels each device holds whole
        groups (no communication); on a whole input it runs replicated (WholeGroupedConv2D),
        and on split channels with its kernel kept whole by --layout_overrides it gathers
        its input first."""
        if x != CHANNELS:
            return "WholeGroupedConv2D", x, False, False, ""
        kernel = node.weight("kernel")
        if kernel in self.fixed and not self.split(kernel):   # kept whole by --layout_overrides
            return "GatherWholeGroupedConv2D", WHOLE, True, False, ""
        groups = node.config["groups"]
        if groups % self.m:
            raise NotDividing(f"layer {node.name} has {groups} groups, which do not divide by the {self.m} devices "
                              f"of the model axis (each must hold whole groups): change --mesh, or "
                              f"{keep_whole(kernel, 4)}", kernel, 4, f"layer {node.name}'s {groups} groups")
        self.follow(node, SplitGroupedConv2D.VARIABLE_SPECS)
        return "SplitGroupedConv2D", CHANNELS, False, False, ""

    def _merge(self, node: Node, ins: tuple):
        concat_channels = node.cls is L.Concatenate and node.config.get("axis") in (-1, len(node.out_shape))
        if len(set(ins)) == 1 and not (concat_channels and ins[0] == CHANNELS):
            return "", ins[0], False, False, ""
        if ROWS in ins:
            raise UsageError(f"layer {node.name} ({node.cls.__name__}) merges row-split and other activations: "
                             "conv_data_fc_model needs one batch layout up to the first Dense layer")
        if concat_channels:   # local shards would interleave the operands' channels: gather first
            return "GatherConcatenate", WHOLE, True, False, WHOLE
        # Whole operands are sliced to the split channels (local); backward, their gradient is gathered.
        return f"Split{node.cls.__name__}", CHANNELS, False, False, CHANNELS

    def _refuse_split(self, node: Node, why: str, paths=None):
        """Raises where a rule splits one of `paths` (default: all the layer's variables), which
        the layer runs whole."""
        split = [p for p in (node.weights if paths is None else paths) if self.split(p)]
        if split:
            raise UsageError(f"layer {node.name} ({node.cls.__name__}) {why}, but a rule splits {split[0]} on 'model': "
                             "keep that variable whole (fix the --layout_overrides or --layout_rules rule that splits "
                             "it)")

    def _unplaceable(self, node: Node, why: str):
        raise UsageError(f"layer {node.name} ({node.cls.__name__}) receives activations split on 'model' and {why}: "
                         "replicate the layer before it (a --layout_rules rule, or --layout=fc_only)")
