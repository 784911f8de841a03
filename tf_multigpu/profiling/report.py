"""The communication report: per profiled step, compute and communication time (from the
trace) and, per device, the bytes each kind of communication moved (from the lowered graph)
next to the analytic minimum for the strategy. Written as JSON, Markdown and TensorBoard
scalars; `python -m tools.comm_report --run_dir=RUN_DIR` rebuilds it from a run directory.
"""

from __future__ import annotations

import dataclasses
import json

import tensorflow as tf

from tf_multigpu.errors import UsageError, error_reason
from tf_multigpu.profiling import collectives as coll
from tf_multigpu.profiling import xspace

MIB = 2**20


def build(meta: dict, found: list, minimum: dict, trace_path: str | None) -> dict:
    """The report as a dict. `meta`: strategy, devices, mesh, global batch, model."""
    steps = xspace.step_times(trace_path) if trace_path else []
    mean = {}
    if steps:
        for key in ("step_ms", "communication_ms", "compute_ms"):
            mean[key] = sum(s[key] for s in steps) / len(steps)
        mean["communication_fraction"] = mean["communication_ms"] / mean["step_ms"] if mean["step_ms"] else 0.0
    by_kind = coll.totals(found)
    for kind in by_kind:
        by_kind[kind]["minimum_bytes"] = minimum.get(kind, 0.0)
    forward = sum(c.payload_bytes for c in found if c.kind == "activations" and c.forward and c.op == "all_gather")
    return {
        **meta, "trace": trace_path, "steps": steps, "mean": mean, "bytes_per_device": by_kind,
        "forward_activation_gathers": {"measured_payload_bytes": forward,
                                       "analytic_payload_bytes": minimum.get("forward_activation_payload", 0)},
        "collectives": [dataclasses.asdict(c) | {"moved_bytes": c.moved_bytes,
                                                 "busiest_sent_bytes": c.busiest_sent_bytes} for c in found],
    }


def to_markdown(report: dict) -> str:
    """Two tables: time per profiled step; bytes per device per step by kind."""
    mesh = report.get("mesh") or {}
    lines = [f"# Communication report: {report['strategy']} on {len(report['devices'])} device(s)"
             + (f", mesh batch:{mesh['batch']} x model:{mesh['model']}" if mesh else ""),
             "", f"{report['model']}, global batch {report['global_batch']}. Trace: `{report['trace']}`.", "",
             "| step | step (ms) | compute (ms) | communication (ms) | collective events |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for s in report["steps"]:
        lines.append(f"| {s['step']} | {s['step_ms']:.2f} | {s['compute_ms']:.2f} | "
                     f"{s['communication_ms']:.2f} | {s['collective_events']} |")
    if report["mean"]:
        m = report["mean"]
        lines.append(f"| mean | {m['step_ms']:.2f} | {m['compute_ms']:.2f} | {m['communication_ms']:.2f} "
                     f"({100 * m['communication_fraction']:.0f}%) | |")
    lines += ["", ("Bytes per device per step (MiB): what the collectives carry (payload), what their "
              "algorithm moves (averaged over the devices), what the device that sends most sends (a "
              "reduction to one device sends every sum back from that device), and the least the "
              "strategy must move."), "",
              "| kind | ops | payload | moved | busiest device sends | analytic minimum |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for kind, t in report["bytes_per_device"].items():
        lines.append(f"| {kind} | {t['ops']} | {t['payload_bytes'] / MIB:.3f} | {t['moved_bytes'] / MIB:.3f} | "
                     f"{t['busiest_sent_bytes'] / MIB:.3f} | {t['minimum_bytes'] / MIB:.3f} |")
    fwd = report["forward_activation_gathers"]
    if fwd["analytic_payload_bytes"]:
        lines += ["", (f"Forward activation all-gathers: {fwd['measured_payload_bytes'] / MIB:.3f} MiB measured, "
                  f"{fwd['analytic_payload_bytes'] / MIB:.3f} MiB for the split layers' outputs.")]
    return "\n".join(lines) + "\n"


def write(report: dict, path_prefix: str, writer=None, step: int | None = None) -> None:
    """Writes PREFIX.json and PREFIX.md, and (with a writer) TensorBoard scalars."""
    with open(path_prefix + ".json", "w") as f:
        json.dump(report, f, indent=2)
    with open(path_prefix + ".md", "w") as f:
        f.write(to_markdown(report))
    if writer is None:
        return
    with writer.as_default():
        for s in report["steps"]:
            for key in ("step_ms", "compute_ms", "communication_ms"):
                tf.summary.scalar(f"communication/{key}", s[key], step=s["step"])
        for kind, t in report["bytes_per_device"].items():
            tf.summary.scalar(f"communication/{kind}_moved_bytes_per_device", t["moved_bytes"], step=step)
            tf.summary.scalar(f"communication/{kind}_minimum_bytes_per_device", t["minimum_bytes"], step=step)
    writer.flush()


def rebuild(run_dir: str) -> dict:
    """Re-reads RUN_DIR's trace and saved collectives; rewrites and returns the report."""
    from tf_multigpu.config import RunPaths
    paths = RunPaths(run_dir)
    saved_path = paths.saved_comm_report()
    try:
        with open(saved_path) as f:
            saved = json.load(f)
        found = [coll.CollectiveOp(**{k: v for k, v in c.items() if k not in ("moved_bytes", "busiest_sent_bytes")})
                 for c in saved["collectives"]]
        minimum = {k: t["minimum_bytes"] for k, t in saved["bytes_per_device"].items()}
        minimum["forward_activation_payload"] = saved["forward_activation_gathers"]["analytic_payload_bytes"]
        meta = {k: saved[k] for k in ("strategy", "devices", "mesh", "global_batch", "model")}
    except (ValueError, KeyError, TypeError, AttributeError) as e:   # not JSON, or not the report's
        raise UsageError(f"{saved_path} is damaged ({type(e).__name__}: {e}): train the run again with "
                         "--profile_steps=A,B into a new --run_dir") from None
    # This run's own trace only: the path saved in the report may be another directory's (a
    # copied run would have reported the original's trace).
    trace = xspace.latest_trace(paths.tensorboard)
    if trace is None:
        raise UsageError(f"{paths.tensorboard} holds no profiler trace (plugins/profile/*/*.xplane.pb): train the "
                         "run again with --profile_steps=A,B into a new --run_dir")
    try:
        report = build(meta, found, minimum, trace)
    except ValueError as e:   # xspace: "... is not a profiler trace"
        raise UsageError(f"{error_reason(e)}: train the run again with --profile_steps=A,B into a new "
                         "--run_dir") from None
    write(report, paths.comm_report)
    return report
