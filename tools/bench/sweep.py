"""One sweep from its settings: list the runs, run them, write tables, JSON, CSV and plots."""

from __future__ import annotations

import importlib.metadata
import os

from tf_multigpu import cli
from tf_multigpu.errors import UsageError
from tools.bench import configs, plots, report, runner


def build_runs(s: dict) -> list:
    """Our runs for the settings, then the peers' twins of our single/data runs."""
    configs.check_lists(s["strategies"], s["devices"], s["batch_sizes"], s["models"], s["peers"])
    common = {k: s[k] for k in ("dataset", "image_size", "warmup_steps", "timed_steps", "cpu_devices", "threads",
                                "dtype", "xla")}
    if s["mode"] == "paper":
        ours = [run for model in s["models"] for batch in s["batch_sizes"]
                for run in configs.paper_runs(model, batch, **common)]
    else:
        ours = configs.grid(s["strategies"], s["devices"], s["batch_sizes"], s["models"], **common)
    if not ours:
        raise UsageError(f"no configuration exists for --strategies={','.join(s['strategies'])} "
                         f"--devices={','.join(map(str, s['devices']))}: single needs 1 device, data/model 2+, "
                         "hybrid 4+ (even), and the batch must divide by the replicas")
    most = max(run.devices for run in ours)
    if s["cpu_devices"] and s["cpu_devices"] < most:
        raise UsageError(f"--cpu_devices={s['cpu_devices']} but the sweep uses up to {most} devices: "
                         f"use --cpu_devices={most} (or drop it)")
    cli.start_tensorflow()   # quietly: TensorFlow loads here, after the cheap checks
    from tf_multigpu.models import get_factory
    for model in s["models"]:
        get_factory(model)   # an unknown model is a usage error before anything runs
    return ours + configs.peer_runs(ours, s["peers"])


def run_sweep(s: dict) -> list[str]:
    """Runs the sweep; returns the paths it wrote."""
    runs = build_runs(s)   # validates the settings first: a usage error stops before TensorFlow loads
    if s["dataset"] == "synthetic" and not s["image_size"]:
        from tf_multigpu.data.synthetic import DEFAULT_SIZE
        s = {**s, "image_size": DEFAULT_SIZE}   # tables and rows then say 224, not "own size"
        runs = build_runs(s)
    data_shapes = _data_shapes(s)
    os.makedirs(s["out_dir"], exist_ok=True)
    s = {**s, "versions": _versions(), "torch_available": runner.torch_available()}
    print(f"{len(runs)} configurations, each in a fresh process; worker logs in "
          f"{os.path.join(s['out_dir'], 'worker_logs.txt')}", flush=True)
    with open(os.path.join(s["out_dir"], "worker_logs.txt"), "w") as log:
        raw = runner.run_all(runs, data_shapes, s["timeout_s"], log, s["repeats"])
    rows = report.summarize(raw)
    out = {name: os.path.join(s["out_dir"], name) for name in ("results.csv", "results.json", "results.md")}
    report.write_csv(rows, out["results.csv"])
    report.write_json(rows, s, out["results.json"])
    table = report.markdown(rows, {k: s[k] for k in ("mode", "dataset", "image_size", "warmup_steps", "timed_steps",
                                                    "repeats", "threads", "cpu_devices")})
    with open(out["results.md"], "w") as f:
        f.write(table)
    print(table, flush=True)
    return list(out.values()) + plots.write_plots(rows, s["out_dir"])


def _data_shapes(s):
    """{(dataset, image_size): {"image_shape", "num_classes"}} for the PyTorch peer; also
    reports a bad --dataset as a usage error before anything runs."""
    from tf_multigpu.data import load_source
    source = load_source(s["dataset"], image_size=s["image_size"])
    return {(s["dataset"], s["image_size"]): {"image_shape": list(source.image_shape),
                                              "num_classes": source.num_classes}}


def _versions():
    out = {}
    for name in ("tensorflow", "keras", "torch", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out
