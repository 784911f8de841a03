"""RQ5's memory table: what every strategy really uses, against what the run estimates.

    python -m tools.memory_table --model=alexnet --dataset=synthetic \\
        --image_size=224 --batch_size=64 --train_steps=3 --out=results/memory_table.md

Each configuration is a fresh `python -m tf_multigpu.train ... --noexport` process on logical
CPU devices (one per device of the configuration), run one at a time, so that each peak is
its own. From its summary.json: the process's peak RSS (`memory_measured`, the measured total
of all its logical devices), its RSS before the model was built (the baseline: TensorFlow,
Python, the data), and the run's estimate per device (`memory_per_device_bytes`), summed over
devices plus the process's host estimate (`memory_host_bytes`: the input pipeline's batches)
to compare with "peak minus baseline"; beside them, the peak of TensorFlow's CPU
allocator (tensors only: the rest of RSS is the runtime, graphs and malloc), and under the
table what glibc's malloc held free when each run ended (memory its arenas keep after the
tensors in it were freed, mostly resident; read at the end of the run, not at the peak). On
GPUs (--gpus) the measured figure is each device's allocator peak and the estimate is
compared per device.

One device's peak RSS moves from run to run with oneDNN's allocator (2.54, 2.74 and 2.63 GiB
in three runs of AlexNet at 64 on 2026-12-04; where it places tensors depends on the order
independent ops run: BUILD_NOTES.md), and every ratio is taken against it: `--repeats=N`
runs each configuration N times and keeps the run with the median peak, listing all N peaks
under the table. The table also says which CPU kernels ran (oneDNN's or TensorFlow's own):
the same step holds different memory with each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from absl import flags

from tf_multigpu import cli, malloc
from tf_multigpu.config.workload_flags import check_workload_flags, define_workload_flags
from tf_multigpu.errors import UsageError

PROG = "memory_table"

# (label, strategy, devices, mesh, layout, extra flags): the configurations of the issue's
# table, the hybrid with its optimizer state sharded over the batch groups, and data
# parallelism reducing each gradient through one device (a star) instead of one packed
# all-reduce.
CONFIGS = (
    ("single", "single", 1, "", "", ()),
    ("data x2", "data", 2, "", "", ()),
    ("model 1x2 filter_split", "model", 2, "batch:1,model:2", "filter_split", ()),
    ("model 1x2 conv_data_fc_model", "model", 2, "batch:1,model:2", "conv_data_fc_model", ()),
    ("data x4", "data", 4, "", "", ()),
    ("model 1x4 filter_split", "model", 4, "batch:1,model:4", "filter_split", ()),
    ("hybrid 2x2 filter_split", "hybrid", 4, "batch:2,model:2", "filter_split", ()),
    ("hybrid 2x2 filter_split sharded optimizer", "hybrid", 4, "batch:2,model:2", "filter_split",
     ("--shard_optimizer_state",)),
    ("data x2 one_device", "data", 2, "", "", ("--all_reduce=one_device",)),
    ("data x4 one_device", "data", 4, "", "", ("--all_reduce=one_device",)),
)
KEYS = {label.replace(" ", "_"): label for label, *_ in CONFIGS}

_WORKLOAD = define_workload_flags(("model", "dataset", "image_size", "batch_size"), model="alexnet",
                                  dataset="synthetic")
flags.DEFINE_integer("train_steps", 3, "Training steps per run.")
flags.DEFINE_list("configs", list(KEYS), f"Configurations to run, of: {', '.join(KEYS)}.")
flags.DEFINE_boolean("gpus", False, "Run on the machine's GPUs instead of logical CPU devices.")
flags.DEFINE_string("out", "", "Also write the markdown table (and a .json beside it) here.")
flags.DEFINE_integer("run_timeout", 1800, "Seconds per run.")
malloc.define_flag()   # tf-multigpu-train's --malloc, given to every run (the table names what was preloaded)
flags.DEFINE_integer("repeats", 1, "Runs per configuration; the one with the median peak is shown.", lower_bound=1)
FLAGS = flags.FLAGS


def run_one(strategy: str, devices: int, mesh: str, layout: str, extra=()) -> dict:
    """One fresh training process; returns its summary.json (printed as its last line)."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "tf_multigpu.train", f"--run_dir={run_dir}", "--noexport",
                   f"--strategy={strategy}", f"--model={FLAGS.model}", f"--dataset={FLAGS.dataset}",
                   f"--image_size={FLAGS.image_size}", f"--batch_size={FLAGS.batch_size}",
                   f"--steps={FLAGS.train_steps}", f"--num_devices={devices}", f"--malloc={FLAGS.malloc}"]
        if not FLAGS.gpus:
            command.append(f"--cpu_devices={devices}")
        if mesh:
            command += [f"--mesh={mesh}", f"--layout={layout}"]
        command += list(extra)
        done = subprocess.run(command, capture_output=True, text=True, timeout=FLAGS.run_timeout)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        cli.fail(PROG, f"{' '.join(command[1:])} failed: {last}", 1)
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(label: str, summary: dict) -> dict:
    """The table's figures for one run's summary."""
    devices = len(summary["devices"])
    per_device = summary["memory_per_device_bytes"]["total"]
    measured = summary["memory_measured"]
    if "peak_bytes_per_device" in measured:   # GPUs: per device, against the estimate per device
        return {"config": label, "devices": devices, "estimate_bytes": per_device,
                "peak_bytes": measured["max_peak_bytes"], "baseline_bytes": 0,
                "measured_bytes": measured["max_peak_bytes"], "per": "device"}
    host = summary.get("memory_host_bytes", {}).get("total", 0)   # the input pipeline: in the RSS, on no device
    return {"config": label, "devices": devices, "estimate_bytes": per_device * devices + host,
            "peak_bytes": measured["peak_rss_bytes"], "baseline_bytes": measured["baseline_rss_bytes"],
            "measured_bytes": measured["peak_minus_baseline_bytes"], "per": "process",
            "tf_allocator_peak_bytes": measured.get("tf_allocator_peak_bytes", 0),
            "malloc_free_bytes": measured.get("malloc_free_bytes"),
            "ld_preload": measured.get("ld_preload", ""),
            "malloc_library": measured.get("malloc_library", ""),
            "cpu_kernels": measured.get("cpu_kernels", "")}


def median_run(rows: list[dict]) -> dict:
    """Of one configuration's runs, the one with the median peak (the lower of the middle two
    for an even count), with every run's peak in "peaks_bytes"."""
    chosen = sorted(rows, key=lambda r: r["peak_bytes"])[(len(rows) - 1) // 2]
    return {**chosen, "peaks_bytes": [r["peak_bytes"] for r in rows]}


def markdown(rows: list[dict]) -> str:
    """The table: peak, ratio to single, estimate, measured minus baseline, their ratio."""
    single = next((r["peak_bytes"] for r in rows if r["config"] == "single"), None)
    gib = 2**30
    per = rows[0]["per"] if rows else "process"
    peak = "process RSS" if per == "process" else "per device"
    lines = [f"| configuration | peak ({peak}) | ratio to single | "
             f"estimate ({'summed over devices' if per == 'process' else 'per device'}) | "
             f"measured{' minus baseline' if per == 'process' else ''} | estimate / measured | TF allocator peak |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = f"{r['peak_bytes'] / single:.2f}" if single else "-"
        agree = f"{r['estimate_bytes'] / r['measured_bytes']:.2f}" if r["measured_bytes"] > 0 else "-"
        allocator = f"{r['tf_allocator_peak_bytes'] / gib:.2f} GiB" if r.get("tf_allocator_peak_bytes") else "-"
        lines.append(f"| {r['config']} | {r['peak_bytes'] / gib:.2f} GiB | {ratio} | "
                     f"{r['estimate_bytes'] / gib:.2f} GiB | {r['measured_bytes'] / gib:.2f} GiB | {agree} | "
                     f"{allocator} |")
    notes = []   # under the table, after a blank line (else markdown reads them as rows)
    if per == "process" and rows:
        baselines = ", ".join(f"{r['config']} {r['baseline_bytes'] / gib:.2f} GiB" for r in rows)
        notes.append(f"Baseline (process RSS before the model is built): {baselines}.")
        kernels = sorted({r["cpu_kernels"] for r in rows if r.get("cpu_kernels")})
        if kernels:
            notes.append(f"CPU kernels: {', '.join(kernels)}.")
        preloads = sorted({r["ld_preload"] for r in rows if r.get("ld_preload")})
        if preloads:
            notes.append(f"Preloaded (LD_PRELOAD): {', '.join(preloads)}.")
        libraries = sorted({r["malloc_library"] for r in rows if r.get("malloc_library")})
        if libraries:   # what the runs' malloc really was (a preload can be refused)
            notes.append(f"malloc from: {', '.join(libraries)}.")
        if any(r.get("malloc_free_bytes") is not None for r in rows):
            free = ", ".join(f"{r['config']} {r['malloc_free_bytes'] / gib:.2f} GiB" for r in rows
                             if r.get("malloc_free_bytes") is not None)
            notes.append(f"Held free by glibc's malloc when training ended (freed memory its arenas keep, "
                         f"mostly resident, in no tensor): {free}.")
    if any(len(r.get("peaks_bytes", ())) > 1 for r in rows):
        peaks = "; ".join(f"{r['config']} " + ", ".join(f"{p / gib:.2f}" for p in
                                                         r.get("peaks_bytes", [r["peak_bytes"]])) for r in rows)
        notes.append(f"Peaks of every run (GiB; the median run is shown): {peaks}.")
    if notes:
        lines += [""] + notes
    return "\n".join(lines) + "\n"


def check_flags():
    """What the flags decide, before any run (UsageError, one line): a value each run would
    refuse in its own process came back as that process's failure, exit 1."""
    check_workload_flags()
    for name, low in (("train_steps", 1), ("run_timeout", 1)):
        if FLAGS[name].value < low:
            raise UsageError(f"--{name}={FLAGS[name].value} must be >= {low}")
    if not FLAGS.configs:
        raise UsageError(f"--configs is empty: choose from {', '.join(KEYS)}")
    if FLAGS.gpus and not cli.nvidia_device_present():   # without starting TensorFlow
        raise UsageError("--gpus: this machine has no NVIDIA GPU; drop --gpus to measure logical CPU devices")
    if FLAGS.out:
        if os.path.isdir(FLAGS.out):
            raise UsageError(f"--out={FLAGS.out} is a directory: give a file name, e.g. --out=results/memory.md")
        ancestor = os.path.dirname(os.path.abspath(FLAGS.out))
        while not os.path.exists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if not os.path.isdir(ancestor):
            raise UsageError(f"--out={FLAGS.out} is under a file ({ancestor}): give a path in a directory")
        earlier = [p for p in (FLAGS.out, _json_path(FLAGS.out)) if os.path.exists(p)]
        if earlier:
            raise UsageError(f"--out={FLAGS.out}: {' and '.join(earlier)} hold an earlier run's table: give a new "
                             "--out, or move them out first")


def _json_path(out: str) -> str:
    return os.path.splitext(out)[0] + ".json"


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
    unknown = [c for c in FLAGS.configs if c not in KEYS]
    if unknown:
        cli.fail(PROG, f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(KEYS)}")
    malloc.check_value(FLAGS.malloc)
    check_flags()
    chosen = [c for c in CONFIGS if c[0].replace(" ", "_") in FLAGS.configs]
    rows = []
    for label, strategy, devices, mesh, layout, extra in chosen:
        print(f"  {label} ...", file=sys.stderr, flush=True)
        rows.append(median_run([row(label, run_one(strategy, devices, mesh, layout, extra))
                                for _ in range(FLAGS.repeats)]))
    table = markdown(rows)
    print(f"{FLAGS.model}, {FLAGS.dataset} image {FLAGS.image_size or 'default'}, global batch {FLAGS.batch_size}, "
          f"{FLAGS.train_steps} steps, a fresh process per run\n")
    print(table)
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "w") as f:
            f.write(table)
        with open(_json_path(FLAGS.out), "w") as f:
            json.dump(rows, f, indent=1)


def run():
    """Entry point: `python -m tools.memory_table`."""
    cli.run(main, PROG, _WORKLOAD)


if __name__ == "__main__":
    run()
