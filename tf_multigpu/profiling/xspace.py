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
