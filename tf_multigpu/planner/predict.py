"""Predicted step time and memory per device of every plan the package can run, ranked.

A plan is (strategy, mesh batch x model, layout policy): `single` (one device), `data` (all N
devices replicate the model), `model` (mesh 1 x N) and `hybrid` (B x M, both > 1) under each
built-in layout of `parallel/layouts.py` (conv_data_fc_model on `model` only: it splits the
batch over the model axis). For each, from the model's per-layer cost (`cost_model`) and a
DeviceProfile:

  compute     = FLOPs one device runs per step / its sustained rate. A device runs its
                group's whole batch (global / B) through layers that are not split (the
                model axis computes them redundantly, as DTensor does) and 1/M of it through
                split ones and through layers whose rows are split (conv_data_fc_model's
                convolutions); SplitConv2D's im2col formulation costs `split_conv_overhead` x
                its einsum FLOPs (measured against tf.nn.conv2d, BUILD_NOTES.md).
                The profile may add a fixed cost per operation (`op_count`) and the
                optimizer update's memory traffic (5 x the device's weight bytes / the
                update bandwidth measured with all devices busy; alone for `single`).
                A profile with `native_split_conv` runs split convolutions at their plain FLOPs.
  activations = the all-gathers (forward) and input-gradient all-reduces (backward; a
                reduce-scatter where the profile's implementation sends each device only
                its shard) of the model-parallel layers, over the model axis, all B groups
                at once; plus 3 values per example for a softmax over split classes. On the
                critical path: no overlap.
  gradients   = the all-reduce of each device's gradient bytes over the batch axis (data:
                over all N, one packed tensor; layers whose rows are split: over B x M;
                DTensor: one per tensor), all M groups at once, with the algorithm a run
                would use (--all_reduce, else the profile's). Exposed fraction 1 -
                `grad_overlap`; the default overlap is 0 because our step overlaps nothing:
                Keras all-reduces every gradient in one pack inside `optimizer.apply`,
                after the backward pass ends.
  collectives : `comm.py`: each algorithm (ring, star to one device, hierarchical copy,
                DTensor's padded gather) as phases of transfers, each transfer on the links
                of the profile's topology; a link carrying k transfers takes k times as long.
                On the default topology (`ring`: every device its own link) a ring all-reduce
                costs 2(n-1)/n x bytes / bandwidth + 2(n-1) x latency, an all-gather half.
  input       = global batch / the input pipeline's images/s (measured profiles, the run's own
                batches read alone). On logical CPU devices the pipeline computes on the
                devices' cores, so it adds to the step; elsewhere it overlaps the step, which
                waits only for what is left. The same for every plan (one pipeline per run).
  syncs       = the tiny all-reduces DTensor's step runs besides those: the 3 scalars a step
                returns (loss sum, correct, count) over the batch axis, and a split
                convolution's ordering scalars (split_conv.py: each chunk waits for the
                previous one through a sum of it; the weight gradient waits for dy) plus one
                input-gradient all-reduce per chunk beyond the first; priced as a collective
                of 4 bytes on its group: latency only.
  step time   = compute + activations + (1 - grad_overlap) x gradients (+ input, or at least
                input).
  memory      = `parallel/memory.py`'s estimate, the one the run's summary reports:
                parameters + gradients + momentum slot (this device's shards) + what each
                layer's implementation keeps for the backward + the input batch + the largest
                transient; it fits if <= `memory_fraction` x the device's memory.

The binding resource is memory for a plan that does not fit, else the larger of compute and
exposed communication. Plans that do not fit are ranked after every plan that does and are
never the recommendation.
"""

from __future__ import annotations

import dataclasses

from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.layouts import BATCH_ON_MODEL, POLICIES, assign_specs
from tf_multigpu.parallel.mesh_spec import mesh_flag
from tf_multigpu.parallel.split_conv import CHUNK_BYTES, row_chunks
from tf_multigpu.planner import comm
from tf_multigpu.planner.cost_model import BYTES_PER_VALUE, ModelCost, memory_per_device, placement
from tf_multigpu.planner.device_profile import (
    UPDATE_BYTES_PER_PARAM_BYTE,
    DeviceProfile,
)

# DTensor's lowered step all-reduces, per example, the split logits' max, the softmax's sum and
# the label's logit (`logits/BiasAdd/DTensorAllReduceOp` x2, `SoftmaxCrossEntropyWithLogits/
# DTensorAllReduceOp` in the comm report), on top of gathering the logits for the accuracy.
SOFTMAX_EXCHANGE_VALUES = 3
# What a training step returns, summed over the batch axis: one scalar all-reduce each under DTensor.
# training/step.SCALARS, spelled out: the planner predicts a step, it does not import the
# training that runs one (tests/test_imports.py keeps training from importing the planner).
STEP_SCALARS = ("loss_sum", "correct", "count")


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """The knobs of the prediction, all stated in the table's footer."""

    grad_overlap: float = 0.0          # fraction of the gradient all-reduce hidden behind compute
    split_conv_overhead: float = 1.3   # SplitConv2D time / tf.nn.conv2d time at equal FLOPs, where
                                       # the profile has no measured value (BUILD_NOTES: 1.24-1.5 on CPU)
    memory_fraction: float = 0.9       # usable share of a device's memory (runtime, workspace)
    all_reduce: str = ""               # --all_reduce of the run (data parallelism; "": the profile's default)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One candidate and its prediction (times in seconds, sizes in bytes, per device)."""

    strategy: str
    batch_groups: int           # size of the mesh's batch axis: data-parallel groups
    model_devices: int          # size of the mesh's model axis: devices sharing each split layer
    layout: str                 # "" for single / data
    per_device_batch: int       # examples each device's group runs through unsplit layers
    compute_s: float = 0.0
    activation_comm_s: float = 0.0
    grad_comm_s: float = 0.0
    input_s: float = 0.0        # the input pipeline's time per global batch (0: not modelled)
    step_time_s: float = 0.0
    activation_comm_bytes: float = 0.0
    grad_comm_bytes: float = 0.0
    memory: dict = dataclasses.field(default_factory=dict)
    fits: bool = True
    binding: str = ""
    speedup: float = 0.0
    error: str = ""             # why the plan cannot run (then nothing else is set)
    algorithm: str = ""         # the gradient reduction's algorithm (planner/comm.py)
    overrides: tuple = ()       # --layout_overrides rules (REGEX, SPEC) amending `layout`

    @property
    def devices(self) -> int:
        return self.batch_groups * self.model_devices

    @property
    def mesh(self) -> str:
        """The --mesh flag value ("" where the strategy takes none)."""
        if self.strategy not in ("model", "hybrid"):
            return ""
        return mesh_flag({"batch": self.batch_groups, "model": self.model_devices})

    @property
    def label(self) -> str:
        if self.strategy == "single":
            return "single"
        if self.strategy == "data":
            return f"data x{self.batch_groups}"
        return f"{self.strategy} {self.batch_groups}x{self.model_devices} {self.layout}"

    def flags(self) -> str:
        """The tf-multigpu-train flags that run this plan."""
        out = f"--strategy={self.strategy}"
        if self.mesh:
            out += f" --mesh={self.mesh} --layout={self.layout}"
        if self.mesh and self.overrides:
            out += " --layout_overrides='" + ";".join(f"{regex}={spec}" for regex, spec in self.overrides) + "'"
        return out

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(mesh=self.mesh, label=self.label, devices=self.devices)
        return out


def candidates(num_devices: int) -> list[tuple[str, int, int, str]]:
    """(strategy, B, M, layout) for every plan on `num_devices` that config/plan_checks.py allows."""
    out = [("single", 1, 1, "")]
    if num_devices > 1:
        out.append(("data", num_devices, 1, ""))
        out += [("model", 1, num_devices, layout) for layout in POLICIES]
        for m in range(2, num_devices // 2 + 1):
            if num_devices % m == 0 and num_devices // m >= 2:
                out += [("hybrid", num_devices // m, m, layout) for layout in POLICIES
                        if layout not in BATCH_ON_MODEL]
    return out


def _groups(b: int, m: int, axis: str) -> list[list[int]]:
    """Device ids (b * M + m, the mesh's order) of each group along `axis` of a B x M mesh."""
    if axis == "model":
        return [[i * m + j for j in range(m)] for i in range(b)]
    if axis == "batch":
        return [[i * m + j for i in range(b)] for j in range(m)]
    return [list(range(b * m))]   # "all": a layer whose rows are split over both axes


def gradient_algorithm(profile: DeviceProfile, strategy: str, all_reduce: str = "") -> str:
    """The algorithm a run's gradient reduction uses: --all_reduce for data parallelism (its
    flag names, comm.FLAG_ALGORITHM), else the profile's default (what the machine runs)."""
    if strategy == "data" and comm.FLAG_ALGORITHM.get(all_reduce):
        return comm.FLAG_ALGORITHM[all_reduce]
    return profile.all_reduce


def _layer_flops(p, layer, profile: DeviceProfile, overhead: float, m: int) -> float:
    """FLOPs one device runs for one layer per example: the im2col split convolution costs
    `overhead` x its einsum's FLOPs, unless the machine splits convolutions natively. The
    profile's `split_conv_replicated` share of that (the patches of the whole input, which
    every device of the `model` group builds) is not divided by M."""
    if p.split_conv_flops and profile.native_split_conv:
        return (layer.fwd_flops + layer.bwd_flops) / m
    if not p.split_conv_flops:
        return p.fwd_flops + p.bwd_flops
    r = profile.split_conv_replicated
    return overhead * p.split_conv_flops * (r * m + (1 - r))


def sync_collectives(p, layer, global_batch: int) -> dict:
    """{"all" | "batch" | "model": count} of the tiny all-reduces one split convolution adds
    (split_conv.py), by the mesh axes they span: per chunk of output rows after the first, a
    wait on the previous chunk's output (sharded over both axes) and on its patches (over
    `batch`); the weight gradient's wait for dy (both axes); per chunk of input rows after the
    first, an input-gradient all-reduce (over `model`) and a wait on it (over `batch`).
    Chunks hold CHUNK_BYTES of patches of the global batch (the dy patches of the input
    gradient are taken as the forward's x out/in channels, exact for stride 1)."""
    if not p.split_conv_flops or not layer.out_rows:
        return {}
    row_bytes = global_batch * layer.patch_elems * BYTES_PER_VALUE / layer.out_rows
    y_chunks = len(row_chunks(layer.out_rows, int(row_bytes), CHUNK_BYTES))
    out = {"all": y_chunks, "batch": y_chunks - 1, "model": 0}   # y chunks - 1 waits + dy's; patch waits
    if p.input_grad:
        dy_patches = layer.patch_elems * layer.out_elems / max(layer.in_elems, 1)
        x_chunks = len(row_chunks(layer.in_rows, int(global_batch * dy_patches * BYTES_PER_VALUE / layer.in_rows),
                                   CHUNK_BYTES))
        out["model"] += x_chunks - 1
        out["batch"] += x_chunks - 1
    return out


def op_count(layers, strategy: str) -> int:
    """Operations one device launches per step, for the profile's per-operation overhead:
    forward, input gradient, weight gradient and update per weighted layer, forward and
    backward per other layer, and one per collective."""
    ops = sum(4 if p.grad_bytes else 2 for p in layers)
    ops += sum(len(p.collectives) for p in layers)
    if strategy != "data":   # DTensor reduces each gradient tensor on its own; MirroredStrategy packs them
        ops += sum(1 for p in layers if p.grad_bytes)
    return ops + (1 if strategy == "data" else 0)


def predict_plan(cost: ModelCost, profile: DeviceProfile, global_batch: int, strategy: str, b: int, m: int,
                 layout: str, assumptions: Assumptions = Assumptions(), overrides=()) -> Plan:
    """The prediction for one plan (a Plan with `error` set when it cannot run); `overrides`
    (--layout_overrides, parsed) amend a model or hybrid plan's layout."""
    group_batch = global_batch // b
    overrides = tuple(tuple(rule) for rule in overrides) if strategy in ("model", "hybrid") else ()
    plan = Plan(strategy, b, m, layout, group_batch, overrides=overrides)
    if global_batch % b:
        return dataclasses.replace(plan, error=f"global batch {global_batch} does not divide by {b} replicas")
    if layout in BATCH_ON_MODEL and global_batch % (b * m):   # training refuses it (config/plan_checks.py)
        return dataclasses.replace(plan, error=f"global batch {global_batch} does not divide by the {b * m} devices "
                                               f"{layout} splits it over")
    try:
        layers = placement(cost, layout or None, {"batch": b, "model": m}, overrides)
    except UsageError as e:
        return dataclasses.replace(plan, error=str(e))
    # split convolutions run the group's whole batch (their filters are split, not their rows)
    overhead = profile.split_conv_overhead_at(group_batch) or assumptions.split_conv_overhead
    by_name = {layer.name: layer for layer in cost.layers}

    def rate(p):   # rows split over `model` run a 1/M share of the group's examples
        if strategy == "single":
            return profile.alone_flops_per_s
        examples = group_batch / m if p.rows_split else group_batch
        if by_name[p.name].kind == "dense":   # reads its whole kernel per batch: its own rate
            return profile.dense_flops_at(examples)
        return profile.flops_at(examples)

    compute = sum(_layer_flops(p, by_name[p.name], profile, overhead, m) * group_batch / rate(p) for p in layers)
    compute += profile.per_op_overhead_s * op_count(layers, strategy)
    memory_rate = (profile.single_device_memory_bandwidth_bytes_per_s if strategy == "single" else 0.0) \
        or profile.memory_bandwidth_bytes_per_s
    if memory_rate:   # the optimizer update each device runs on its own weights (shards)
        compute += UPDATE_BYTES_PER_PARAM_BYTE * sum(p.grad_bytes for p in layers) / memory_rate
    act_s = act_bytes = 0.0
    for p in layers:
        gathered = any(c.op == "all_gather" for c in p.collectives)
        for c in p.collectives:
            nbytes = c.elems_per_example * group_batch * BYTES_PER_VALUE
            op, algorithm = c.op, (profile.activation_gather if c.op == "all_gather" else "ring")
            if op == "all_reduce" and gathered:   # the input was split: each device needs its shard back
                op = profile.input_grad_reduce
            act_s += comm.seconds(profile, algorithm, op, _groups(b, m, "model"), nbytes)
            act_bytes += comm.moved_bytes(algorithm, op, m, nbytes)
            if c.layer == "loss":   # a softmax over split classes also sums 3 values per example
                nbytes = SOFTMAX_EXCHANGE_VALUES * group_batch * BYTES_PER_VALUE   # across the shards
                act_s += comm.seconds(profile, "ring", "all_reduce", _groups(b, m, "model"), nbytes)
                act_bytes += comm.moved_bytes("ring", "all_reduce", m, nbytes)
    if strategy in ("model", "hybrid"):   # DTensor: the step's scalars and the split convolutions' waits
        syncs = {"batch": len(STEP_SCALARS)}   # sums over the batch axis (the loss is replicated on `model`)
        for p in [] if profile.native_split_conv else layers:   # a native split conv orders nothing
            for axis, count in sync_collectives(p, by_name[p.name], global_batch).items():
                syncs[axis] = syncs.get(axis, 0) + count
        act_s += sum(count * comm.seconds(profile, "ring", "all_reduce", _groups(b, m, axis), BYTES_PER_VALUE)
                     for axis, count in syncs.items())
    grads = sum(p.grad_bytes for p in layers)
    algorithm = gradient_algorithm(profile, strategy, assumptions.all_reduce)
    axes = ["all" if p.rows_split else "batch" for p in layers]   # devices summing each layer's gradients
    if strategy == "data":   # MirroredStrategy packs every gradient into one all-reduce
        grad_s = comm.seconds(profile, algorithm, "all_reduce", _groups(b, m, "batch"), grads)
    else:                    # DTensor: one all-reduce per gradient tensor
        grad_s = sum(comm.seconds(profile, algorithm, "all_reduce", _groups(b, m, axis), p.grad_bytes)
                     for axis, p in zip(axes, layers))
    grad_bytes = sum(comm.moved_bytes(algorithm, "all_reduce", b * (m if axis == "all" else 1), p.grad_bytes)
                     for axis, p in zip(axes, layers))
    exposed = act_s + (1 - assumptions.grad_overlap) * grad_s
    input_s = global_batch / profile.input_images_per_s if profile.input_images_per_s else 0.0
    step = compute + exposed + input_s if profile.input_shares_cores else max(compute + exposed, input_s)
    memory = memory_per_device(cost, layout or None, {"batch": b, "model": m}, global_batch, overrides)
    fits = memory["total"] <= assumptions.memory_fraction * profile.memory_bytes
    binding = ("memory" if not fits else "input" if input_s > max(compute, exposed)
               else "compute" if compute >= exposed else "communication")
    return dataclasses.replace(plan, compute_s=compute, activation_comm_s=act_s, grad_comm_s=grad_s,
                               input_s=input_s, step_time_s=step, activation_comm_bytes=act_bytes,
                               grad_comm_bytes=grad_bytes,
                               memory=memory, fits=fits, binding=binding, algorithm=algorithm)


@dataclasses.dataclass(frozen=True)
class PlanTable:
    """Every candidate, ranked: fitting plans by predicted step time, then the others."""

    model_name: str
    global_batch: int
    num_devices: int
    profile: DeviceProfile
    assumptions: Assumptions
    plans: tuple          # runnable plans, ranked
    skipped: tuple        # plans that cannot run (error set)

    @property
    def best(self) -> Plan:
        """The recommendation: the fastest plan that fits (UsageError if none does)."""
        if not self.plans or not self.plans[0].fits:
            raise UsageError(f"no plan for {self.model_name} with global batch {self.global_batch} fits in "
                             f"{self.profile.memory_bytes / 2**30:.1f} GiB per device: use a smaller --batch_size "
                             "or more devices")
        return self.plans[0]

    def to_dict(self) -> dict:
        return {"model": self.model_name, "global_batch": self.global_batch, "num_devices": self.num_devices,
                "profile": self.profile.to_dict(), "assumptions": dataclasses.asdict(self.assumptions),
                "plans": [p.to_dict() for p in self.plans], "skipped": [p.to_dict() for p in self.skipped],
                "recommended": self.plans[0].to_dict() if self.plans and self.plans[0].fits else None,
                "explanation": explain(self)}


def plan_table(cost: ModelCost, profile: DeviceProfile, num_devices: int, global_batch: int,
               assumptions: Assumptions = Assumptions(), overrides=()) -> PlanTable:
    """Predicts every candidate plan on `num_devices` and ranks them; `overrides`
    (--layout_overrides, parsed) amend every model and hybrid plan's layout."""
    if num_devices < 1:
        raise UsageError(f"cannot plan for {num_devices} devices: give --num_devices >= 1")
    if overrides:   # a rule that matches no variable is the user's mistake in every plan: say it once
        assign_specs({p: s for n in cost.nodes for p, s in n.weights.items()}, overrides, {"batch": 1, "model": 1},
                     flag="--layout_overrides rule")
    plans = [predict_plan(cost, profile, global_batch, *c, assumptions, overrides) for c in candidates(num_devices)]
    ok = [p for p in plans if not p.error]
    single = next((p for p in ok if p.strategy == "single"), None)
    ok = [dataclasses.replace(p, speedup=single.step_time_s / p.step_time_s if single and p.step_time_s else 0.0)
          for p in ok]
    ok.sort(key=lambda p: (not p.fits, p.step_time_s))
    return PlanTable(cost.name, global_batch, num_devices, profile, assumptions, tuple(ok),
                     tuple(p for p in plans if p.error))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def explain(table: PlanTable) -> str:
    """Why the top plan wins, in numbers, against the best data-parallel (or runner-up) plan."""
    fitting = [p for p in table.plans if p.fits]
    if not fitting:
        return "No plan fits in memory."
    best = fitting[0]
    rival = next((p for p in table.plans if p.strategy == "data" and p is not best), None)
    rival = rival or next((p for p in table.plans if p is not best), None)

    def parts(p):
        return (f"{p.label}: {_ms(p.step_time_s)} ms = compute {_ms(p.compute_s)} + activation exchange "
                f"{_ms(p.activation_comm_s)} ({_mib(p.activation_comm_bytes)} MiB per device) + gradient all-reduce "
                f"{_ms((1 - table.assumptions.grad_overlap) * p.grad_comm_s)} "
                f"({_mib(p.grad_comm_bytes)} MiB per device)"
                + (f" + input pipeline {_ms(p.input_s)}" if p.input_s else "")
                + f"; {_mib(p.memory['total'])} MiB per device{'' if p.fits else ' (does not fit)'}")

    text = f"Recommended {best.label} ({best.flags()}), {best.binding}-bound. {parts(best)}."
    if rival:
        text += (f" Against {parts(rival)}: {best.label} is {rival.step_time_s / best.step_time_s:.2f}x faster "
                 f"per step.")
    return text


def to_markdown(table: PlanTable) -> str:
    """The ranked table, with the profile and assumptions it rests on."""
    p = table.profile
    lines = [
        (f"# Plans for {table.model_name}, global batch {table.global_batch}, {table.num_devices} "
         f"device{'s' if table.num_devices != 1 else ''}, profile {p.name}"
         + (f" (which describes {p.num_devices}: its other figures are per device)"
            if p.num_devices and p.num_devices != table.num_devices else "")),
        "",
        ("| rank | plan | flags | step ms | compute ms | activation comm ms | gradient comm ms | comm MiB/device "
         "| memory MiB/device | fits | binding | speedup |"),
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for rank, plan in enumerate(table.plans, 1):
        lines.append(
            f"| {rank} | {plan.label} | `{plan.flags()}` | {_ms(plan.step_time_s)} | {_ms(plan.compute_s)} | "
            f"{_ms(plan.activation_comm_s)} | {_ms(plan.grad_comm_s)} | "
            f"{_mib(plan.activation_comm_bytes + plan.grad_comm_bytes)} | {_mib(plan.memory['total'])} | "
            f"{'yes' if plan.fits else '**no**'} | {plan.binding} | {plan.speedup:.2f}x |")
    for plan in table.skipped:
        lines.append(f"| - | {plan.label} | `{plan.flags()}` | cannot run: {plan.error} | | | | | | | | |")
    a = table.assumptions
    lines += [
        "",
        explain(table),
        "",
        (f"Profile {p.name}: {p.flops_per_s / 1e12:.3g} TFLOP/s sustained per device "
         f"({p.peak_flops_per_s / 1e12:.3g} peak x {p.compute_efficiency:g} efficiency; one device alone "
         f"{p.alone_flops_per_s / 1e12:.3g}), {p.memory_bytes / 2**30:.1f} GiB per device, links "
         f"{p.link_bandwidth_bytes_per_s / 1e9:.3g} GB/s"
         + (f" (root complex {p.host_bandwidth_bytes_per_s / 1e9:.3g} GB/s, shared)"
            if p.host_bandwidth_bytes_per_s else "")
         + f" and {p.link_latency_s * 1e6:.3g} us per transfer phase"
         + (f", {p.collective_overhead_s * 1e3:.3g} ms per collective" if p.collective_overhead_s else "")
         + (f", {p.per_op_overhead_s * 1e6:.3g} us per operation" if p.per_op_overhead_s else "")
         + (f", input pipeline {p.input_images_per_s:.0f} images/s"
            + (" on the devices' cores (adds to the step)" if p.input_shares_cores else " (overlaps the step)")
            if p.input_images_per_s else "") + ". "
         + p.description),
        "",
        (f"Assumptions: step = compute + activation exchange (on the critical path) + "
         f"{1 - a.grad_overlap:g} x gradient all-reduce (grad_overlap={a.grad_overlap:g}); gradients reduced by "
         f"{gradient_algorithm(p, 'data', a.all_reduce)} (data parallel; {p.all_reduce} otherwise), activations "
         f"gathered by {p.activation_gather}, on a {p.topology} topology (planner/comm.py); "
         f"FLOPs of convolutions and dense layers (2 per multiply-add) and pooling only; split convolutions "
         f"cost {p.split_conv_overhead or a.split_conv_overhead:.3g}x their FLOPs; a plan fits if its memory per "
         f"device (parallel/memory.py: parameters, gradients, momentum, activations, input, backward "
         f"transient, update and all-reduce buffers) <= {a.memory_fraction:g} x device memory. Speedup is against "
         f"`single` on one device of the same profile."),
    ]
    return "\n".join(lines) + "\n"
