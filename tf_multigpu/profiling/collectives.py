"""The collectives one training step runs on one device, with their bytes and kind.

Read from TensorFlow's own graphs, not from our code's intentions, so the report shows what
really runs:
- tf.distribute (`single`, `data`): the traced step function's graph, where the all-reduces
  are ops with static input shapes (MirroredStrategy packs all gradients into one tensor), or,
  with `--all_reduce=one_device`, no collective op at all: copies to one device, an AddN
  there, copies back, counted from the graph's cross-device edges.
- DTensor (`model`, `hybrid`): collectives exist only after DTensor's SPMD expansion, which
  happens in the runtime; TensorFlow writes that graph when TF_DUMP_GRAPH_PREFIX is set
  before it starts (`enable_graph_dumps`), and we parse it.

Bytes moved per device follow the algorithm each op runs: an all-reduce over g devices moves
2(g-1)/g of its payload per device (ring: reduce-scatter then all-gather), an all-gather or a
reduce-scatter (g-1)/g, an all-to-all (g-1)/g; a reduction to one device moves its counted
copies / g on average, the same 2(g-1)/g, but all through the reducing device, which sends
g-1 payloads (`busiest_sent_bytes`; a ring device sends 2(g-1)/g). On a model-only mesh
DTensor lowers an all-gather to a CollectiveGatherV2 between two transposes
(parallel/dtensor_mesh.py); on a mesh with a batch axis, to an all-reduce of a zero-padded
buffer (`CollectiveReduceV2` named `DTensorAllGatherOp`). Both are counted as gathers.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf
from google.protobuf import text_format

from tf_multigpu.compat import branch_graphs

KINDS = ("gradients", "parameters", "activations", "scalars")


@dataclasses.dataclass
class CollectiveOp:
    """One collective op found in a step's graph, seen from one device: what ran.

    Not `parallel.placement.Collective`, which is what the placement plan says a layer must
    communicate (per example, on a mesh axis) before anything runs.
    """
    name: str
    op: str            # "all_reduce", "all_gather", "reduce_scatter", "all_to_all"
    kind: str          # one of KINDS
    payload_bytes: int # the tensor this device contributes / receives in full
    group_size: int
    forward: bool      # part of the forward pass (not the gradient computation or update)
    op_type: str = ""  # the TensorFlow op that runs it, e.g. CollectiveGatherV2
    # A reduction to one device (no collective op: copies in, a sum, copies back) counts its
    # copies from the graph's edges: into the reducing device, and out of it (at least one,
    # reductions_to_one_device keeps only sums read back). 0 for a collective op.
    copies_in: int = 0
    copies_out: int = 0

    @property
    def moved_bytes(self) -> float:
        """Bytes one device of the group sends, averaged over the group."""
        g = self.group_size
        if g <= 1:
            return 0.0
        if self.copies_out:
            return self.payload_bytes * (self.copies_in + self.copies_out) / g
        factor = 2 * (g - 1) / g if self.op == "all_reduce" else (g - 1) / g
        return self.payload_bytes * factor

    @property
    def busiest_sent_bytes(self) -> float:
        """Bytes the device that sends most sends: moved_bytes for the ring algorithms, where
        every device sends alike; for a reduction to one device, that device's copies back."""
        return self.payload_bytes * self.copies_out if self.copies_out else self.moved_bytes


def _op_kind(op_type: str) -> str | None:
    if "AllToAll" in op_type:
        return "all_to_all"
    if "ReduceScatter" in op_type:
        return "reduce_scatter"
    if "Gather" in op_type or "AllGather" in op_type:
        return "all_gather"
    if op_type.startswith("Collective") and "Reduce" in op_type or op_type in ("NcclAllReduce", "NcclReduce"):
        return "all_reduce"
    return None


def from_function_graph(graph, device: str, one_device: bool = False) -> list[CollectiveOp]:
    """Collectives on `device` in a traced tf.distribute step function: the graph of one step
    (`DistributeParallelism.compile(...).one_step`), which holds exactly that step's
    collectives; with `one_device` (the run's --all_reduce), also its reductions to one
    device, which have no collective op.

    Inside a `cond`, the collectives of the branch that moves the most bytes: float16's loss
    scaling applies the update, all-reducing its gradients, in the branch a step takes when
    they are finite, and skips it in the other (a step that updates is what the report
    describes). Not inside a while loop, whose trip count the graph does not say; a step
    has none around its collectives."""
    found = []
    for op in graph.get_operations():
        branches = [from_function_graph(branch, device, one_device) for branch in branch_graphs(op)]
        if branches:
            found += max(branches, key=lambda ops: sum(c.moved_bytes for c in ops))
        kind_of_op = _op_kind(op.type)
        if kind_of_op is None or not op.device.endswith(device.split("device:")[-1]):
            continue
        tensor = op.inputs[0]
        payload = int(np.prod(tensor.shape.as_list())) * tensor.dtype.size
        group = _group_size(op)
        kind = "scalars" if tensor.shape.rank == 0 else "gradients"   # data parallelism reduces only gradients
        found.append(CollectiveOp(op.name, kind_of_op, kind, payload, group, forward=False, op_type=op.type))
    return found + (reductions_to_one_device(graph) if one_device else [])


def reductions_to_one_device(graph) -> list[CollectiveOp]:
    """The all-reduces of `--all_reduce=one_device` (tf.distribute.ReductionToOneDevice) in a
    traced step, which have no collective op. Each is an AddN on the reducing device whose other
    inputs come from the other replicas' devices (a copy of each tensor), and whose sum is read
    on the other devices (one copy per device: TensorFlow sends a tensor once to each device
    that reads it). Counted from those edges, for every device of the group.

    Only sums read back elsewhere are all-reduces: the loss and metric sums the host reads
    (`strategy.reduce`) are AddNs nobody else reads, reduces to one device, and not counted.
    The optimizer sums its gradients (SUM); a MEAN would put a division between the AddN and
    the copies back, which this does not follow."""
    found = []
    for op in graph.get_operations():
        if op.type != "AddN" or not op.device:
            continue
        senders = {t.name: t.op.device for t in op.inputs if t.op.device and t.op.device != op.device}
        readers = {c.device for c in op.outputs[0].consumers() if c.device and c.device != op.device}
        if not senders or not readers:
            continue
        tensor = op.outputs[0]
        found.append(CollectiveOp(op.name, "all_reduce", "scalars" if tensor.shape.rank == 0 else "gradients",
                                  int(np.prod(tensor.shape.as_list())) * tensor.dtype.size,
                                  len({op.device, *senders.values(), *readers}), forward=False, op_type="AddN",
                                  copies_in=len(senders), copies_out=len(readers)))
    return found


def _group_size(op) -> int:
    if op.type == "NcclAllReduce":
        return op.get_attr("num_devices")
    try:
        return int(tf.get_static_value(op.inputs[1]))
    except (TypeError, ValueError, IndexError):
        return 1


_DUMP_DIR_ENV = "TF_MULTIGPU_GRAPH_DUMPS"
_STEP_FUNCTION = "__inference_train_step"   # tf.function(train_step), the DTensor step


def enable_graph_dumps() -> str:
    """Makes TensorFlow write the graphs of the DTensor training step to a temporary folder.

    Must run before TensorFlow executes its first function: the runtime reads
    TF_DUMP_GRAPH_PREFIX once and keeps it (setting it later has no effect). The entry point
    calls this for --profile_steps with a DTensor strategy.
    """
    directory = tempfile.mkdtemp(prefix="tf_multigpu_graphs_")
    os.environ["TF_DUMP_GRAPH_PREFIX"] = directory
    os.environ["TF_DUMP_GRAPH_NAME_FILTER"] = _STEP_FUNCTION   # a name-prefix match
    os.environ[_DUMP_DIR_ENV] = directory
    return directory


def read_lowered_step(global_batch: int = 0, weight_shapes=frozenset()) -> list[CollectiveOp] | None:
    """The collectives of the DTensor step's lowered graph (None if dumps were not enabled),
    then deletes the dumps. The arguments help tell activations from weights (see below)."""
    directory = os.environ.get(_DUMP_DIR_ENV)
    if not directory:
        return None
    dumps = sorted(f for f in glob.glob(os.path.join(directory, "*after_post_rewrite_for_exec_passes*"))
                   if "_partition_" not in f)
    if not dumps:
        return None
    graph_def = tf.compat.v1.GraphDef()
    with open(dumps[-1]) as f:
        text_format.Parse(f.read(), graph_def)
    shutil.rmtree(directory, ignore_errors=True)
    os.environ.pop("TF_DUMP_GRAPH_PREFIX", None)
    return from_dtensor_graph_def(graph_def, global_batch, weight_shapes)


def from_dtensor_graph_def(graph_def, global_batch: int = 0, weight_shapes=frozenset()) -> list[CollectiveOp]:
    """Collectives of DTensor's per-device program (the SPMD-expanded step).

    Kind, from the layout DTensor attaches to each op and the tensor's shape: a per-example
    tensor (first dimension sharded on `batch`, or of the global batch's size, as the batch
    that conv_data_fc_model gathers whole and its gradient are, or integer labels of that
    size) is activations or their gradients, moving across `model`; a parameter-shaped tensor
    (`weight_shapes`) being all-reduced is a gradient summed across `batch`, being gathered is
    a parameter; a scalar is a loss or metric.

    DTensor combines independent collectives of a group into one buffer (e.g. every conv
    gradient all-reduce with the gather of split logits for the accuracy): such a buffer is
    reported as its parts, each classified by its own tensor, none as a layer's forward output.
    """
    nodes = {n.name: n for n in graph_def.node}
    parts = {}   # combined collective -> the slices that take its parts back out
    for n in graph_def.node:
        if n.name.endswith("/PostCombinedReduceSlice") and n.input:
            parts.setdefault(n.input[0].split(":")[0], []).append(n)
    found = []
    for node in graph_def.node:
        if not node.op.startswith("Collective"):
            continue
        op = "all_gather" if "AllGather" in node.name else _op_kind(node.op)
        if op is None:
            continue
        dtype = tf.dtypes.as_dtype(node.attr["T"].type)
        size_node = nodes.get(node.input[1].split(":")[0]) if len(node.input) > 1 else None
        group = int(size_node.attr["value"].tensor.int_val[0]) if size_node is not None and \
            size_node.attr["value"].tensor.int_val else 1
        for part in parts.get(node.name, []):
            name = part.name.removeprefix("tf.StatefulPartitionedCall/").removesuffix("/PostCombinedReduceSlice")
            flat = nodes.get(part.name.removesuffix("/PostCombinedReduceSlice") + "/CombinedReduceFlatten")
            shape = _shape(nodes.get(flat.input[0].split(":")[0])) if flat else _shape(part)
            part_op = "all_gather" if "AllGather" in name else "all_reduce"
            found.append(CollectiveOp(name, part_op, _kind(shape, [], part_op, dtype, global_batch, weight_shapes),
                                    int(np.prod(_shape(part))) * dtype.size, group, forward=False,
                                    op_type=node.op))
        if node.name in parts:
            continue
        if node.op == "CollectiveGatherV2":
            shape, specs = _gathered_tensor(node, nodes)
            packed = False   # a gather is of one tensor
        else:
            shape = _shape(node) or _shape(nodes.get(node.input[0].split(":")[0]))
            specs = _specs(node)
            # DTensor may pack several tensors into one flat buffer: its layout then has more
            # dimensions than the buffer. Such a buffer is not one layer's forward output.
            packed = shape is not None and len(specs) != len(shape)
        payload = int(np.prod(shape)) * dtype.size if shape is not None else 0
        name = node.name.removeprefix("tf.StatefulPartitionedCall/")
        # A custom gradient's own name scope (a relayout's "activation_gradients",
        # split_layers.relayout_activations; split_conv's) is not under "gradient_tape".
        backward = "gradient_tape" in name or "/activation_gradients/" in f"/{name}"
        found.append(CollectiveOp(name, op, _kind(shape, specs, op, dtype, global_batch, weight_shapes), payload,
                                group, forward=not backward and not packed, op_type=node.op))
    return found


def _specs(node) -> list[str]:
    """The sharding spec of each dimension in the layout DTensor attached to `node` ([] if none)."""
    layout = node.attr["_layout"].list.s[0].decode() if "_layout" in node.attr else ""
    specs = layout.split("sharding_specs:")[-1].split(" mesh")[0].split(",")
    return [spec for spec in specs if spec]


def _gathered_tensor(node, nodes):
    """(shape, specs) of the tensor a lowered CollectiveGatherV2 gathers, in its own layout.

    The gather concatenates along the first dimension, so DTensor transposes the sharded
    dimension to the front, gathers, and transposes back; the gather itself carries no
    layout (`empty_layout`). The tensor is the Transpose's input, whole: its shape is the
    gathered one with the Transpose's permutation undone, its specs are the input's.
    """
    gathered = _shape(node)
    source = nodes.get(node.input[0].split(":")[0])
    if source is None or source.op != "Transpose":
        return gathered, _specs(source) if source is not None else []
    perm_node = nodes.get(source.input[1].split(":")[0])
    local = nodes.get(source.input[0].split(":")[0])
    specs = _specs(local) if local is not None else []
    if gathered is None or perm_node is None or perm_node.op != "Const":
        return gathered, specs
    perm = tf.make_ndarray(perm_node.attr["value"].tensor).tolist()
    shape = [0] * len(perm)
    for out_dim, in_dim in enumerate(perm):
        shape[in_dim] = gathered[out_dim]
    return shape, specs


def _kind(shape, specs, op, dtype, global_batch, weight_shapes) -> str:
    """One of KINDS for a collective's tensor (see from_dtensor_graph_def)."""
    if not shape:
        return "scalars"
    if specs and specs[0] == "batch" or global_batch and shape[0] == global_batch and (
            tuple(shape) not in weight_shapes or dtype.is_integer):
        return "activations"
    return "parameters" if op == "all_gather" else "gradients"


def _shape(node):
    if node is None or "_output_shapes" not in node.attr or not node.attr["_output_shapes"].list.shape:
        return None
    shape = node.attr["_output_shapes"].list.shape[0]
    if shape.unknown_rank:
        return None
    return [d.size for d in shape.dim]


def totals(collectives: list[CollectiveOp]) -> dict:
    """{kind: {"payload_bytes", "moved_bytes", "busiest_sent_bytes", "ops"}} per step per device
    (busiest_sent_bytes: summed per op, which is the busiest device's when one device reduces them all)."""
    out = {k: {"payload_bytes": 0, "moved_bytes": 0.0, "busiest_sent_bytes": 0.0, "ops": 0} for k in KINDS}
    for c in collectives:
        out[c.kind]["payload_bytes"] += c.payload_bytes
        out[c.kind]["moved_bytes"] += c.moved_bytes
        out[c.kind]["busiest_sent_bytes"] += c.busiest_sent_bytes
        out[c.kind]["ops"] += 1
    return out
