"""Bytes one device holds during a training step (RQ5): one function, read by the run's report,
`--device_memory_limit`, `tools/max_batch.py` and the planner alike.

Counted from the placement plan, per device:
  parameters, gradients   this device's shards (a split variable holds 1/M);
  optimizer_slots         one momentum buffer per trainable shard (0 with plain SGD), sharded
                          over `batch` too with --shard_optimizer_state (placement.slot_spec);
  activations             what the backward reads of the forward, so what the runtime keeps
                          until then (`parallel/backward_reads.py`, traced from TensorFlow's
                          gradient graph), for the device's share of its group's batch:
                            - a layer's output where its own backward reads it (a ReLU, a
                              max pool) or a consumer's reads it as an input (the next
                              convolution's kernel gradient, BatchNormalization), once however
                              many read it; at its layout's share (1/M where split on `model`,
                              whole where replicated: the replication on `model` is counted);
                              not where nothing reads it (BatchNormalization's output before a
                              ReLU, an add's, a linear convolution's before a BatchNorm is
                              counted as the BatchNorm's input), nor a view (Flatten, Reshape);
                            - a gathered input (SplitConv2D and every Gather* layer after a
                              split one) where the layer's backward reads its input: a new,
                              whole tensor (once where two layers gather the same tensor);
                            - tensors a layer keeps of its own: Dropout's mask, the
                              pre-activation an activation like swish reads, LayerNormalization's
                              normalised input;
                            - a SeparableConv2D's depthwise output, which its pointwise
                              kernel's gradient reads: whole, but split on channels where
                              the layer runs on split channels (SplitSeparableConv2D);
                          SplitConv2D keeps its (gathered) input, never a patch matrix;
                          SlicePool2D its input and output, as a stock max pool (its
                          backward re-slices the window taps from the input); a layer no
                          gradient passes through (before the first weights) keeps nothing;
  input                   the input batch (1/M of it under conv_data_fc_model);
  transient               the largest working set of one layer's backward beyond what is
                          still kept when it runs: the backward frees each layer's kept
                          tensors once it has run, so an early layer's working set comes
                          on top of the early layers' tensors only (the largest of kept up
                          to the layer + its working set, less all activations). A layer's
                          working set: its input gradient (whole where the input is
                          gathered) and its output gradient, twice where an activation is
                          inside the layer; for a SeparableConv2D, its depthwise output's
                          gradient too; for a layer whose window runs as window_sum, its
                          padded dy and one tap (`_window_elems`);
  update                  the optimizer's temporaries: the decayed gradient and the new
                          velocity, 2 x the slot shards (1 x the gradients, the scaled gradient,
                          without momentum; with sharded slots, also the new velocity gathered
                          back, 1 x the gradients). An upper bound since the products wait
                          for their gradient (training/optimizer.py): a variable's exist only
                          briefly after its gradient. Kept at this size: the estimate then
                          stays within 30% of the measured peak on CPUs, where the runtime's
                          memory outside the allocator is not counted (BUILD_NOTES.md,
                          "Memory, fourth pass");
  reduction_buffers       the gradient all-reduce's buffers: MirroredStrategy packs every
                          gradient into one buffer and receives the sum into another (2 x the
                          gradients). DTensor's all-reduce of a gradient runs in place
                          (CollectiveReduceV2 forwards its input: a hybrid step's trace has no
                          new tensor for fc6's reduced gradient), so 0 there (with DTensor's
                          all-reduce combining, which dtensor_mesh.py turns off, it would not be).
  total                   the persistent parts (parameters, slots, input, gradients) plus what
                          is alive at the larger of two moments:
                          - during the backward: activations, transient, and the updates of
                            the variables updated during it (all at once: the upper bound above);
                          - after the backward: one update, the largest of the variables whose
                            gradient TensorFlow's own gradient ops compute over several devices
                            on a DTensor mesh (`_updated_after_backward`: a stock layer's
                            weights, every bias). Those are all-reduced one after another in
                            the optimizer's variable order, the first layer's first, so after
                            the whole backward, and each update waits for its own. The trace
                            of a hybrid 2x2 AlexNet step (224, batch 64; BUILD_NOTES.md,
                            "Twenty-ninth session"): fc6's gradient all-reduced after conv1's
                            backward, then fc6 updated, then fc7; conv2's kernel, summed inside
                            SplitConv2D, updated during the backward;
                          under MirroredStrategy's packed all-reduce, which separates the
                          backward, the all-reduce and the update in time, the largest of the
                          three phases' own parts (`_peak`). So `total` is the parts' sum only
                          where every update runs during the backward (one device, a mesh
                          without shared gradients); `update` is always every update at once.
Beside them, per process and in host memory, not on any device (`host_bytes`):
  input_pipeline          the decoded float32 batches tf.data keeps in flight for training
                          (data/pipeline.py's AUTOTUNE'd parallel map and prefetch): measured
                          alone at 5.4-6.3 batches of AlexNet 224 at batch 64 (208-242 MiB),
                          INPUT_PIPELINE_BATCHES = 6. On logical CPUs it is part of the
                          process's measured peak; on GPUs it is not in any device's.
A model-level estimate: the runtime may fuse or free some tensors early and adds its own
workspace; `summary.json` sets the measured peak beside it.
"""

from __future__ import annotations

import numpy as np

from tf_multigpu.parallel.backward_reads import NOTHING, Reads, has_inner_activation, layer_reads
from tf_multigpu.parallel.placement import BYTES_PER_VALUE, WHOLE, PlacementPlan

# Decoded batches the training input pipeline holds at once (see the docstring).
INPUT_PIPELINE_BATCHES = 6

def saved_elems(plan: PlacementPlan) -> dict:
    """{layer name: values per example of the group batch it keeps on one device for the
    backward}: its output where a backward reads it, its own tensors, its gathered input."""
    reads = {layer.name: _reads(layer) for layer in plan.layers}
    kept = {name for name, r in reads.items() if r.output}
    reads_gathered = set()
    for layer in reversed(plan.layers):   # every consumer before its producer (views pass it on)
        r = reads[layer.name]
        if not (r.inputs or (r.alias and layer.name in kept)):
            continue
        gathered = [lay != WHOLE and layer.gathers for lay in layer.in_layouts]
        kept.update(p for p, g in zip(layer.node.inputs, gathered) if p and not g)
        if any(gathered):
            reads_gathered.add(layer.name)
    saved = {}
    for layer in plan.layers:
        node, r = layer.node, reads[layer.name]
        if not node.inputs:   # the input batch: counted on its own
            saved[layer.name] = 0
            continue
        out = node.out_elems // plan.share(layer.out_layout)
        elems = (out if layer.name in kept and not r.alias else 0) + round(r.own * out)
        elems += round(r.own_in * _input_elems(plan, layer))
        if layer.new_gather and layer.name in reads_gathered:   # a gathered tensor two layers
            elems += layer.collective_elems("all_gather", "forward")   # share is kept once
        saved[layer.name] = elems + _depthwise_elems(plan, layer)
    return saved


def _reads(layer) -> Reads:
    """A layer's backward reads; nothing where no gradient passes through it (no weights of
    its own, none upstream)."""
    if not layer.needs_input_grad and not layer.node.trainable:
        return NOTHING
    return layer_reads(layer.node)


def transient_elems(plan: PlacementPlan, layer) -> int:
    """Values per example alive at once in the layer's backward beyond what is kept: its
    output's gradient and its input's gradient (whole where the input was gathered)."""
    node = layer.node
    if not node.inputs:
        return 0
    dx = _dx_elems(plan, layer)
    out = node.out_elems // plan.share(layer.out_layout)
    # an activation inside the layer: the gradient below it is a second output-sized tensor
    # (small_convnet, batch 1024: the estimate met the allocator's peak, 69 MiB, with it)
    activation = out if has_inner_activation(node) else 0
    return out + activation + dx + _depthwise_elems(plan, layer) + _window_elems(plan, layer)


# The split-aware layers that run as window_sum (parallel/windows.py), and the input-sized
# tensors beside dy and dx that its backward holds at once (`_window_elems`).
_WINDOW_SUM = {"SplitDepthwiseConv2D": 2, "SplitSeparableConv2D": 2, "FilterSplitSeparableConv2D": 2,
               "SliceAvgPool2D": 2, "SplitGroupedConv2D": 9,
               "WholeGroupedConv2D": 9, "GatherWholeGroupedConv2D": 9}
_STRIDED_GROUPED = 2   # a strided grouped window: its dx one stride phase at a time, as an elementwise one


def _window_elems(plan: PlacementPlan, layer) -> int:
    """window_sum's backward transient beside dy and dx. Its sums run one tap at a time
    (`_tap_sum`); an elementwise window holds the padded dy (strided: one stride phase's) and
    one tap with its product: at most 2 input-sized tensors. A grouped convolution's einsums
    also transpose each tap and product to and from group-major order: 9 at stride 1; a
    strided one's dx runs one stride phase at a time at the output's size (`_strided_adjoint`):
    2. Measured, fwd+bwd of one layer, allocator peak in input maps: depthwise 3x3/1 5.8
    (input, output, dy, dx and 1.8), 3x3/2 3.8, average 3x3 3.7 (8.3-16.8 when the kh*kw taps
    were made at once); grouped 3x3/1 12.9 and 3x3/2 4.8 (28x28x192, 8 groups; 10.2 when dx
    convolved the dilated dy)."""
    extra = _WINDOW_SUM.get(layer.impl)
    if extra is None or not plan.layout:   # a replicated model runs the stock layers
        return 0
    config = layer.node.config
    if layer.impl == "SliceAvgPool2D" and config["padding"] == "valid" and (
            tuple(config.get("strides") or config["pool_size"]) == tuple(config["pool_size"])):
        return 0   # tiling windows: a mean over a reshape, not window_sum (SliceAvgPool2D.call)
    if "Grouped" in layer.impl and max(config["strides"]) > 1:
        extra = _STRIDED_GROUPED
    return extra * _dx_elems(plan, layer)


def _dx_elems(plan: PlacementPlan, layer) -> int:
    """The layer's input gradient on one device: whole where the layer gathers its input."""
    return layer.node.in_elems if layer.gathers else _input_elems(plan, layer)


def _input_elems(plan: PlacementPlan, layer) -> int:
    """Values per example of the layer's inputs on one device, each at its layout's share."""
    return sum(int(np.prod(s)) // plan.share(lay) for s, lay in zip(layer.node.in_shapes, layer.in_layouts))


def _depthwise_elems(plan: PlacementPlan, layer) -> int:
    """A SeparableConv2D's depthwise output (or its gradient) on one device: split where its
    depthwise part runs on a split input (channels, or rows under conv_data_fc_model), whole
    where it runs whole (FilterSplitSeparableConv2D gathers its input)."""
    split = layer.impl == "SplitSeparableConv2D" and layer.in_layouts[0] != WHOLE
    return layer.node.depthwise_elems // (plan.mesh["model"] if split else 1)


def bytes_per_device(plan: PlacementPlan, global_batch: int, slots_per_parameter: int = 1) -> dict:
    """{"parameters", "gradients", "optimizer_slots", "activations", "input", "transient",
    "update", "reduction_buffers", "total"} in bytes, for one device of a step on
    `global_batch` examples."""
    group_batch = global_batch // plan.mesh["batch"]
    params = grads = slots = 0
    during_grads = during_slots = 0   # of the variables updated during the backward
    after_update = 0                  # the largest update of those updated after it
    for layer in plan.layers:
        for path, shape in layer.node.weights.items():
            local = plan.local_elems(path, shape)
            params += local
            if path in layer.node.trainable:
                grads += local
                slot = plan.local_slot_elems(path, shape)
                slots += slot
                if _updated_after_backward(plan, layer, path):   # one after another
                    after_update = max(after_update, _update_elems(plan, local, slot, slots_per_parameter))
                else:
                    during_grads, during_slots = during_grads + local, during_slots + slot
    # one process' tf.distribute data parallelism (a replicated plan) packs all gradients
    packed = not plan.layout and plan.mesh["batch"] > 1
    buffers = 2 * grads if packed else 0
    saved = saved_elems(plan)
    activations = sum(saved.values()) * group_batch
    # The backward runs the layers last to first and frees what each kept once it has run:
    # a layer's working set comes on top of what it and the layers before it keep.
    kept_before, peak = 0, 0
    for layer in plan.layers:
        kept_before += saved[layer.name]
        peak = max(peak, kept_before + transient_elems(plan, layer))
    transient = peak * group_batch - activations
    first = plan.layers[0]
    out = {"parameters": params * BYTES_PER_VALUE, "gradients": grads * BYTES_PER_VALUE,
           "optimizer_slots": slots * slots_per_parameter * BYTES_PER_VALUE,
           "activations": activations * BYTES_PER_VALUE,
           "input": first.node.out_elems * group_batch // plan.share(first.out_layout) * BYTES_PER_VALUE,
           "transient": transient * BYTES_PER_VALUE,
           "update": _update_elems(plan, grads, slots, slots_per_parameter) * BYTES_PER_VALUE,
           "reduction_buffers": buffers * BYTES_PER_VALUE}
    during = _update_elems(plan, during_grads, during_slots, slots_per_parameter)
    out["total"] = _peak(out, packed, during * BYTES_PER_VALUE, after_update * BYTES_PER_VALUE)
    return out


def _updated_after_backward(plan: PlacementPlan, layer, path: str) -> bool:
    """Whether variable `path`'s update runs only after the backward. On a DTensor mesh, a
    gradient that TensorFlow's own gradient ops compute over devices sharing the variable (a
    stock layer's weights, gathered input or not; every bias, added by a BiasAdd) is
    all-reduced where the optimizer reads it: those all-reduces run one after another in the
    optimizer's variable order, after the whole backward, and each update waits for its own
    (traced on hybrid 2x2: AlexNet's Dense kernels and biases, SplitConv2D's biases). A
    gradient a split-aware layer computes itself is summed inside the layer and counted
    during the backward, the larger estimate: SplitConv2D's kernel (traced: updated during
    it), window_sum's weights, LeanBatchNormalization's gamma and beta (not traced). Not with
    --shard_optimizer_state: its Dense gradients wait too (traced: alive at the peak, in
    conv2's backward), but its peak is then the backward's, whose padded inputs and chunk
    slices the estimate does not count; the sum is kept (1.03x the allocator's peak, where
    the rule would give 0.74x)."""
    if not plan.layout or plan.shard_slots or plan.gradient_group(layer) == 1:
        return False
    stock = layer.impl in ("", "Gather" + layer.node.cls.__name__) and layer.node.cls.__name__ != "BatchNormalization"
    return stock or path.rsplit("/", 1)[-1] == "bias"


def largest_batch(plan: PlacementPlan, limit_bytes: int, step: int, slots_per_parameter: int = 1) -> int:
    """The largest global batch, a multiple of `step` (the replicas), whose `bytes_per_device`
    total is at most `limit_bytes`; 0 where not even `step` fits. The total grows with the
    batch, piecewise linearly (`_peak`), so doubling and then bisecting finds it."""
    def fits(units: int) -> bool:
        return bytes_per_device(plan, units * step, slots_per_parameter)["total"] <= limit_bytes

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high) and high < 2**40:   # the input alone grows with the batch: this ends
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * step


def _peak(parts: dict, packed: bool, update_during: int, update_after: int) -> int:
    """The persistent parts (gradients included) plus the larger of what the backward holds
    (activations, its transient, the updates that run during it: `update_during` bytes) and
    the largest update that waits for it (`update_after`). Where every gradient goes through
    one packed all-reduce, that all-reduce needs the whole backward done, and the update needs
    it, so what only the backward holds, the all-reduce's buffers and the update's
    temporaries are never alive together: the largest of the three. (AlexNet 224/64, data x2
    / x4 on logical CPUs: the sum was 1.42x / 1.50x the measured peak above the baseline,
    this is 0.94x / 1.06x; BUILD_NOTES.md, "Eighteenth session".) The plan does not know the
    all-reduce's algorithm: --all_reduce=one_device, which reduces each gradient on its own,
    gets this too, and is over-estimated (data x4: 1.34x)."""
    persistent = parts["parameters"] + parts["optimizer_slots"] + parts["input"] + parts["gradients"]
    backward = parts["activations"] + parts["transient"]
    if packed:
        return persistent + max(backward, parts["reduction_buffers"], parts["update"])
    return persistent + max(backward + parts["reduction_buffers"] + update_during, update_after)


def _update_elems(plan: PlacementPlan, grads: int, slots: int, slots_per_parameter: int) -> int:
    """The optimizer's temporaries: the scaled gradient alone without momentum; with it, the
    decayed gradient and the new velocity on the slot's shard, plus, where slots are sharded
    over `batch`, the new velocity all-gathered into the variable's layout."""
    if not slots_per_parameter:
        return grads
    return 2 * slots + (grads if plan.shard_slots else 0)


def host_bytes(image_shape, batch_rows: int) -> dict:
    """{"input_pipeline", "total"}: host memory of one process's training input, for the
    `batch_rows` rows of each global batch that this process reads (images of `image_shape`,
    float32 after preprocessing)."""
    pipeline = INPUT_PIPELINE_BATCHES * batch_rows * int(np.prod(image_shape)) * BYTES_PER_VALUE
    return {"input_pipeline": pipeline, "total": pipeline}
