"""From raw run results to the benchmark's tables: statistics, speedup, peers, files.

Per run: median images/s over the timed steps with its spread (p10 and p90 of the per-step
rates), speedup against one device (same implementation, model, data and global batch),
scaling efficiency (speedup / devices), bytes per device (parallel/memory.py), and for our
`single`/`data` runs the ratio of our images/s to each peer's on the same devices.
Writes results.csv (COLUMNS), results.json (rows plus the sweep's settings) and results.md.
"""

from __future__ import annotations

import csv
import json
import statistics

import numpy as np

from tools.bench.configs import PAPER_CONFIGS, PAPER_NAMES, PAPER_SPEEDUP, PEERS, config_label

MEMORY_PARTS = ("parameters", "gradients", "optimizer_slots", "activations", "total")

# results.csv, in this order. Times in seconds, memory in bytes per device; empty = not
# measured (peers have no memory figures; an `error` row has no timings).
COLUMNS = (
    "kind", "label", "model", "dataset", "image_size", "strategy", "devices", "mesh", "global_batch",
    "step_time_median_s", "step_time_p10_s", "step_time_p90_s",
    "images_per_s_median", "images_per_s_p10", "images_per_s_p90",
    "speedup", "efficiency", "compute_s", "communication_s",
    *(f"memory_{part}_bytes" for part in MEMORY_PARTS),
    *(f"ours_vs_{peer}" for peer in PEERS),
    "warmup_steps", "timed_steps", "repeats", "threads", "device_kind", "parameters", "error",
)


def communication_split(row: dict) -> dict:
    """The median step time split into compute and communication, in seconds.

    The worker traces a few extra steps with the profiler (tf_multigpu.profiling: the union
    of collective-op intervals per step); tracing slows steps down, so the traced FRACTION of
    communication is applied to the untraced median step time. None (empty cells) for peers
    and failed runs."""
    traced_step, traced_comm = row.get("traced_step_s"), row.get("traced_communication_s")
    median = row.get("step_time_median_s")
    if not traced_step or median is None or traced_comm is None:
        return {"compute_s": None, "communication_s": None}
    communication = median * traced_comm / traced_step
    return {"compute_s": median - communication, "communication_s": communication}


def summarize(raw_rows: list[dict]) -> list[dict]:
    """Rows with statistics, speedup, efficiency and peer ratios, in COLUMNS' terms."""
    rows = [_statistics(r) for r in raw_rows]
    device_kind = next((r["device_kind"] for r in rows if r.get("device_kind")), "GPU")
    for row in rows:
        row["label"] = config_label(row["strategy"], row["devices"], device_kind)
        base = _find(rows, row, devices=1)
        if base and row["images_per_s_median"] and base["images_per_s_median"]:
            row["speedup"] = row["images_per_s_median"] / base["images_per_s_median"]
            row["efficiency"] = row["speedup"] / row["devices"]
        row.update(communication_split(row))
    for row in rows:
        if row["kind"] == "ours" and row["strategy"] in ("single", "data"):
            for peer in PEERS:
                twin = _find(rows, row, kind=peer, strategy=row["strategy"])
                if twin and twin["images_per_s_median"] and row["images_per_s_median"]:
                    row[f"ours_vs_{peer}"] = row["images_per_s_median"] / twin["images_per_s_median"]
    return rows


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row.get(k) for k in COLUMNS})


def write_json(rows, settings: dict, path):
    with open(path, "w") as f:
        json.dump({"settings": settings, "columns": list(COLUMNS), "rows": rows}, f, indent=1, default=str)


def markdown(rows, settings: dict) -> str:
    """The tables: the paper's layout where its configurations ran, every configuration, peers."""
    parts = [f"# Benchmark ({settings.get('note', '')})".rstrip(" ()"), "",
             f"Settings: {json.dumps(settings, sort_keys=True)}", ""]
    ours = [r for r in rows if r["kind"] == "ours"]
    for (model, dataset, size, batch) in _groups(ours):
        group = [r for r in ours
                 if (r["model"], r["dataset"], r["image_size"], r["global_batch"]) == (model, dataset, size, batch)]
        if any((r["strategy"], r["devices"]) in PAPER_SPEEDUP for r in group if r["devices"] > 1):
            parts += _paper_table(group, model, dataset, size, batch)
    parts += _all_table(ours)
    parts += _peer_table(rows)
    return "\n".join(parts) + "\n"


def _paper_table(group, model, dataset, size, batch):
    kind = next((r.get("device_kind") for r in group if r.get("device_kind")), "?")
    lines = [f"## {model}, {dataset} {_size(size)}, global batch {batch}: the paper's table "
             f"(Yadan et al. 2013, Table 1; measured on {kind} devices)", "",
             "| configuration | time per step (ms) | images/s (p10-p90) | speedup | efficiency | paper's speedup |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for key in PAPER_CONFIGS:
        row = next((r for r in group if (r["strategy"], r["devices"]) == key), None)
        name = PAPER_NAMES[key]
        if row is None:
            lines.append(f"| {name} | not run | | | | {PAPER_SPEEDUP[key]:.1f} |")
        elif row.get("error"):
            lines.append(f"| {name} | failed: {row['error']} | | | | {PAPER_SPEEDUP[key]:.1f} |")
        else:
            lines.append(f"| {name} | {_ms(row['step_time_median_s'])} | {_rate(row)} | {_x(row.get('speedup'))} "
                         f"| {_pct(row.get('efficiency'))} | {PAPER_SPEEDUP[key]:.1f} |")
    return lines + [""]


def _all_table(ours):
    lines = ["## Every configuration (ours)", "",
             "| model | data | batch | configuration | mesh | time per step (ms) | images/s (p10-p90) | speedup "
             "| efficiency | compute (ms) | communication (ms) | memory per device (MiB) |",
             "| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in ours:
        head = (f"| {r['model']} | {r['dataset']} {_size(r['image_size'])} | {r['global_batch']} | {r['label']} "
                f"| {r['mesh'] or '-'}")
        if r.get("error"):
            lines.append(f"{head} | failed: {r['error']} | | | | | | |")
            continue
        mem = r.get("memory_total_bytes")
        lines.append(f"{head} | {_ms(r['step_time_median_s'])} | {_rate(r)} | {_x(r.get('speedup'))} "
                     f"| {_pct(r.get('efficiency'))} | {_ms(r.get('compute_s'))} | {_ms(r.get('communication_s'))} "
                     f"| {'' if mem is None else f'{mem / 2**20:.1f}'} |")
    return lines + [""]


def _peer_table(rows):
    ours = [r for r in rows if r["kind"] == "ours" and r["strategy"] in ("single", "data")]
    if not ours or not any(r["kind"] in PEERS for r in rows):
        return []
    lines = ["## Ours against the peers (same model, global batch and devices; data parallel)", "",
             "| model | data | batch | devices | ours images/s | Keras fit images/s | ours / Keras fit "
             "| PyTorch DDP images/s | ours / PyTorch DDP |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in ours:
        cells = []
        for peer in PEERS:
            twin = _find(rows, r, kind=peer, strategy=r["strategy"])
            if twin is None:
                cells += ["not run", ""]
            elif twin.get("error"):
                cells += [twin["error"], ""]
            else:
                cells += [f"{twin['images_per_s_median']:.1f}", _x(r.get(f"ours_vs_{peer}"))]
        ours_rate = "failed" if r.get("error") else f"{r['images_per_s_median']:.1f}"
        lines.append(f"| {r['model']} | {r['dataset']} {_size(r['image_size'])} | {r['global_batch']} | {r['devices']} "
                     f"| {ours_rate} | {' | '.join(cells)} |")
    return lines + [""]


def _statistics(raw: dict) -> dict:
    row = {k: v for k, v in raw.items() if k not in ("step_times_s", "memory_bytes", "batch")}
    row["global_batch"] = raw["batch"]
    times = raw.get("step_times_s") or []
    for part in MEMORY_PARTS:
        row[f"memory_{part}_bytes"] = (raw.get("memory_bytes") or {}).get(part)
    row.update({k: None for k in ("step_time_median_s", "step_time_p10_s", "step_time_p90_s", "images_per_s_median",
                                  "images_per_s_p10", "images_per_s_p90", "speedup", "efficiency")})
    if times:
        rates = [raw["batch"] / t for t in times]
        row.update(step_time_median_s=statistics.median(times), step_time_p10_s=_quantile(times, 0.1),
                   step_time_p90_s=_quantile(times, 0.9), images_per_s_median=statistics.median(rates),
                   images_per_s_p10=_quantile(rates, 0.1), images_per_s_p90=_quantile(rates, 0.9))
    elif not row.get("error"):
        row["error"] = "no timed steps"
    return row


def _quantile(values, q):
    """Linear-interpolated quantile (numpy's default), as a float for the JSON report."""
    return float(np.quantile(values, q))


def _find(rows, like, **changes):
    """The row doing `like`'s work with `changes` (kind, strategy, devices) applied."""
    want = {"kind": like["kind"], "model": like["model"], "dataset": like["dataset"], "image_size": like["image_size"],
            "global_batch": like["global_batch"], "devices": like["devices"], "strategy": like["strategy"], **changes}
    if want["devices"] == 1:
        want["strategy"] = "single"
    return next((r for r in rows if all(r.get(k) == v for k, v in want.items())), None)


def _groups(rows):
    seen = []
    for r in rows:
        key = (r["model"], r["dataset"], r["image_size"], r["global_batch"])
        if key not in seen:
            seen.append(key)
    return seen


def _size(size):
    return f"{size}x{size}" if size else "(own size)"


def _ms(seconds):
    return "" if seconds is None else f"{seconds * 1000:.1f}"


def _rate(row):
    return f"{row['images_per_s_median']:.1f} ({row['images_per_s_p10']:.0f}-{row['images_per_s_p90']:.0f})"


def _x(value):
    return "" if value is None else f"{value:.2f}"


def _pct(value):
    return "" if value is None else f"{100 * value:.0f}%"
