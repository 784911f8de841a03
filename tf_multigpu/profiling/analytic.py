"""The fewest bytes each device must move per training step, from the model and its layout.

With B data-parallel groups and M devices per group (data: B = N, M = 1; model: B = 1, M = N):
- gradients: every parameter shard is summed over the g devices that share its layer's
  input rows (the plan's gradient group: the B groups; all N devices for conv_data_fc_model's
  data-parallel convolutions); a ring all-reduce moves 2(g-1)/g of the shard's bytes per
  device (the bandwidth-optimal all-reduce).
- activations: where a layer needs the whole of an input that the layer before split over
  `model` (on channels or units, or on rows: conv_data_fc_model's batch before the first
  dense layer), the input is all-gathered ((M-1)/M of its bytes per device) and, backward,
  its gradient is reduce-scattered back to the shards ((M-1)/M again). A layer whose kernel
  is split but whose input is whole (e.g. the first split dense after a replicated flatten)
  sends back a partial input gradient to be all-reduced (2(M-1)/M), except the first layer
  with weights, which needs no input gradient. A SeparableConv2D split on its filters
  (FilterSplitSeparableConv2D) sums its depthwise output's gradient over them instead:
  reduce-scattered on channels ((M-1)/M) where each device needs its channels only (a split
  input's gradient, or only the depthwise kernel's), all-reduced where the input's gradient
  must be whole. A merge of a split and a whole operand slices the whole one locally; its
  gradient is all-gathered back ((M-1)/M).
- parameters: 0 (the built-in layouts never move weights).
"""

from __future__ import annotations

from tf_multigpu.parallel.placement import BYTES_PER_VALUE, WHOLE, PlacementPlan


def minimum_bytes(plan: PlacementPlan, global_batch: int) -> dict:
    """{"gradients", "parameters", "activations", "forward_activation_payload"} per device, read
    from the placement plan.

    `forward_activation_payload` is the size of the activations gathered forward (before
    any algorithm factor): what the measured forward all-gathers must add up to, the split
    logits' gather for the accuracy included (training/step.py takes their argmax).
    """
    group_batch = global_batch // plan.mesh["batch"]
    m = plan.mesh["model"]
    out = {"gradients": 0.0, "parameters": 0.0, "activations": 0.0, "forward_activation_payload": 0}
    for layer in plan.layers:
        group = plan.gradient_group(layer)
        grads = sum(plan.local_elems(p, layer.node.weights[p]) for p in layer.node.trainable) * BYTES_PER_VALUE
        out["gradients"] += grads * 2 * (group - 1) / group
    if m == 1:
        return out
    share = (m - 1) / m
    for layer in plan.layers:
        split_input = any(lay != WHOLE for lay in layer.in_layouts)
        if layer.impl == "FilterSplitSeparableConv2D":
            gathered = layer.collective_elems("all_gather")
            if layer.new_gather:   # forward only: the backward's sum is the depthwise output's
                out["activations"] += share * group_batch * gathered * BYTES_PER_VALUE
                out["forward_activation_payload"] += group_batch * gathered * BYTES_PER_VALUE
            reduced = layer.collective_elems("all_reduce")
            whole_dx = not split_input and layer.needs_input_grad
            out["activations"] += (2 if whole_dx else 1) * share * group_batch * reduced * BYTES_PER_VALUE
            continue
        if not layer.kernel_split:   # LayerNorm's statistics, SeparableConv2D's pointwise partial sums
            reduced = layer.collective_elems("all_reduce")
            out["activations"] += 2 * share * group_batch * reduced * BYTES_PER_VALUE
        gathered = layer.collective_elems("all_gather")
        if layer.new_gather:   # all-gather forward, reduce-scatter backward
            nbytes = group_batch * gathered * BYTES_PER_VALUE
            out["activations"] += 2 * share * nbytes
            out["forward_activation_payload"] += nbytes
        elif layer.gathers:   # reuses a tensor another layer gathered
            continue
        elif layer.kernel_split and not split_input and layer.needs_input_grad:
            # partial input gradients, all-reduced
            out["activations"] += 2 * share * group_batch * layer.node.in_elems * BYTES_PER_VALUE
        # a Split<Merge>'s whole operands were sliced: their gradients are gathered back whole
        out["activations"] += share * group_batch * layer.collective_elems("all_gather", "backward") * BYTES_PER_VALUE
    for c in plan.collectives:
        if c.layer == "loss":   # split logits, gathered for the loss's and the accuracy's argmax (forward only)
            nbytes = group_batch * c.elems_per_example * BYTES_PER_VALUE
            out["activations"] += share * nbytes
            out["forward_activation_payload"] += nbytes
    return out
