"""Step and communication times from a profiler trace (the XSpace protobuf TensorFlow writes).

Read with the profiler's own protobuf (`compat.xplane_pb2`), not by
scraping text. A step is a `train` event carrying `step_num` (what
`compat.profiler_step` records, and what TensorBoard's
profile plugin shows as steps). Communication is every collective op event (TensorFlow ops
whose type starts with `Collective`, e.g. `CollectiveReduceV2` on CPU) and every NCCL kernel
(on GPU planes); its time in a step is the union of their intervals inside the step, so
overlapping collectives on several devices count once: the time during which some device
was communicating. Compute is the rest of the step.
"""

from __future__ import annotations

import glob
import os
import re

from tf_multigpu.compat import xplane_pb2


def latest_trace(logdir: str) -> str | None:
    """The newest `*.xplane.pb` under logdir/plugins/profile/ (None if there is none)."""
    traces = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    return max(traces, key=os.path.getmtime) if traces else None


def _is_communication(name: str) -> bool:
    op_type = name.rsplit(":", 1)[-1]
    return op_type.startswith("Collective") or "nccl" in name.lower()


def step_times(path: str) -> list[dict]:
    """[{step, step_ms, communication_ms, compute_ms, collective_events}] per traced step."""
    space = xplane_pb2().XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    steps, comms = {}, []
    for plane in space.planes:
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                start, end = base + event.offset_ps, base + event.offset_ps + event.duration_ps
                if name == "train":
                    stats = {stat_names.get(s.metadata_id): s for s in event.stats}
                    if "step_num" in stats:
                        steps[stats["step_num"].int64_value] = (start, end)
                elif _is_communication(name):
                    comms.append((start, end))
    out = []
    for step, (start, end) in sorted(steps.items()):
        inside = sorted((max(s, start), min(e, end)) for s, e in comms if s < end and e > start)
        busy, reach = 0, start
        for s, e in inside:   # union of intervals
            if e > reach:
                busy += e - max(s, reach)
                reach = e
        step_ps = end - start
        out.append({"step": int(step), "step_ms": step_ps / 1e9, "communication_ms": busy / 1e9,
                    "compute_ms": (step_ps - busy) / 1e9, "collective_events": len(inside)})
    return out


def allocations_at_peak(path: str) -> dict:
    """The allocators' peak inside the trace, replayed from its MemoryAllocation and
    MemoryDeallocation events (TensorFlow records them for a GPU's allocator, and for the CPU
    allocator with oneDNN on): {allocator: {"start_bytes" (in use when the trace began),
    "peak_bytes", "peak_op" (whose allocation reached it), "alive": [(op, count, bytes)]}},
    "alive" being the allocations made inside the trace that are alive at the peak, grouped by
    op name (with the numbers DTensor and TensorFlow append to repeated names dropped), largest
    first. What was allocated before the trace (weights, slots) is in the peak, not in "alive".
    The xprof memory_profile tool lists only a sample of them."""
    space = xplane_pb2().XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                kind = names.get(event.metadata_id)
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {}
                for s in event.stats:
                    ref = stat_names.get(s.ref_value) if s.ref_value else None
                    stats[stat_names.get(s.metadata_id)] = s.str_value or ref or s.int64_value or s.uint64_value
                events.append((line.timestamp_ns * 1000 + event.offset_ps, kind == "MemoryAllocation", stats))
    events.sort(key=lambda e: e[0])
    out = {}
    for allocator in sorted({str(s.get("allocator_name", "")) for _, _, s in events}):
        alive, peak, at_peak, start = {}, -1, None, None
        for _, allocation, stats in (e for e in events if str(e[2].get("allocator_name", "")) == allocator):
            size, in_use = int(stats.get("allocation_bytes") or 0), int(stats.get("bytes_allocated") or 0)
            if start is None:
                start = in_use - size if allocation else in_use + size
            if allocation:
                alive[stats.get("addr")] = (str(stats.get("tf_op") or "(no op)"), size)
            else:
                alive.pop(stats.get("addr"), None)
            if in_use > peak:
                peak, at_peak = in_use, (str(stats.get("tf_op") or "(no op)"), dict(alive))
        groups = {}
        for op, size in at_peak[1].values():
            key, name = _op_group(op)
            count, total, names = groups.get(key, (0, 0, set()))
            groups[key] = (count + 1, total + size, names | {name})
        alive = [(next(iter(names)) if len(names) == 1 else key + "_*", count, total)
                 for key, (count, total, names) in groups.items()]
        out[allocator] = {"start_bytes": start, "peak_bytes": peak, "peak_op": at_peak[0],
                          "alive": sorted(alive, key=lambda r: -r[2])}
    return out


def _op_group(op: str) -> tuple[str, str]:
    """(group, name) of an op: the op without the call prefix and without the numbers that
    repeated names get, one group per op of the model whichever device or chunk ran it; the
    name keeps the op's own number (MatMul_1, a kernel's gradient, is not MatMul, the input's)."""
    scope, _, last = op.replace("tf.StatefulPartitionedCall/", "").rpartition("/")
    scope = re.sub(r"(?<=[^/])_\d+(?=/|$)", "", scope)   # alexnet_1/conv2_1 -> alexnet/conv2
    prefix = scope + "/" if scope else ""
    return prefix + re.sub(r"_\d+$", "", last), prefix + last
