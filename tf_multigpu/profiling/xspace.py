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


def _load(path: str):
    """The trace's XSpace; ValueError for a file that is no trace."""
    space = xplane_pb2().XSpace()
    with open(path, "rb") as f:
        try:
            space.ParseFromString(f.read())
        except Exception as e:   # protobuf's DecodeError
            raise ValueError(f"{path} is not a profiler trace ({e})") from e
    return space


def step_times(path: str) -> list[dict]:
    """[{step, step_ms, communication_ms, compute_ms, collective_events}] per traced step."""
    steps, comms = {}, []
    for plane in _load(path).planes:
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
    "alive" being the allocations made inside the trace that are alive at the peak, by op,
    largest first (`_grouped`). What was allocated before the trace (weights, slots) is in the
    peak, not in "alive". The xprof memory_profile tool lists only a sample of them. Raises
    ValueError for a file that is no trace."""
    by_allocator = {}
    for plane in _load(path).planes:
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
                if "addr" in stats and "bytes_allocated" in stats:   # both are needed to replay it
                    by_allocator.setdefault(str(stats.get("allocator_name", "")), []).append(
                        (line.timestamp_ns * 1000 + event.offset_ps, kind == "MemoryAllocation", stats))
    out = {}
    for allocator, events in sorted(by_allocator.items()):
        events.sort(key=lambda e: e[0])   # stable: events at one time keep the trace's order
        alive, start, peak, at_peak = {}, None, None, None
        for _, allocation, stats in events:
            size, in_use = int(stats.get("allocation_bytes") or 0), int(stats["bytes_allocated"])
            if start is None:
                start = in_use - size if allocation else in_use + size
                peak, at_peak = start, ("(before the trace)", {})
            if allocation:
                alive[stats["addr"]] = (_short(str(stats.get("tf_op") or "(no op)")), size)
            else:
                alive.pop(stats["addr"], None)
            if in_use > peak:
                peak, at_peak = in_use, (str(stats.get("tf_op") or "(no op)"), dict(alive))
        out[allocator] = {"start_bytes": start, "peak_bytes": peak, "peak_op": at_peak[0],
                          "alive": _grouped(at_peak[1].values())}
    return out


def _short(op: str) -> str:
    return op.replace("tf.StatefulPartitionedCall/", "")


def _grouped(allocations) -> list:
    """[(op, count, bytes)] largest first: one row per op name (the devices of a mesh run one
    op under one name), and one per family of 3 or more ops that differ only in their last
    number (a chunk's or a tap's strided_slice_0 ... _13), named ..._*; two (MatMul, a Dense
    layer's input gradient, and MatMul_1, its kernel's) stay apart."""
    by_op = {}
    for op, size in allocations:
        count, total = by_op.get(op, (0, 0))
        by_op[op] = (count + 1, total + size)
    families = {}
    for op in by_op:
        families.setdefault(re.sub(r"_\d+$", "", op), []).append(op)
    rows = []
    for base, ops in families.items():
        if len(ops) >= 3:
            rows.append((base + "_*", sum(by_op[o][0] for o in ops), sum(by_op[o][1] for o in ops)))
        else:
            rows += [(o, *by_op[o]) for o in ops]
    return sorted(rows, key=lambda r: -r[2])
