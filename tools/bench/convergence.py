"""Test error against wall-clock time for each configuration: the paper's Figure 1.

Each configuration is a fresh `python -m tf_multigpu.train` run on the same data, model,
global batch, seed and step count, evaluating every `eval_every` steps; its TensorBoard
events give test accuracy with the wall-clock time it was logged at. Time 0 is the run's
first event (written once the model is built, before the first step), so start-up
(imports, data loading, building) is left out and tracing the first step is counted.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

from tf_multigpu.config import RunPaths
from tf_multigpu.errors import UsageError
from tools.bench.configs import STRATEGIES, config_label
from tools.bench.runner import REPO

CSV_COLUMNS = ("label", "strategy", "devices", "step", "wall_s", "test_accuracy", "test_error", "test_loss")


def parse_configs(text: str) -> list[tuple[str, int]]:
    """'single:1,data:2,...' -> [("single", 1), ("data", 2), ...]."""
    out = []
    for part in filter(None, text.split(",")):
        strategy, _, n = part.partition(":")
        if strategy not in STRATEGIES or not n.isdigit() or int(n) < 1:
            raise UsageError(f"--configs entry {part!r} is not STRATEGY:DEVICES with STRATEGY one of "
                             f"{', '.join(STRATEGIES)}, e.g. --configs=single:1,data:2,hybrid:4")
        n = int(n)
        if (strategy == "single") != (n == 1) or (strategy == "hybrid" and (n < 4 or n % 2)):
            raise UsageError(f"--configs entry {part!r} does not exist: single runs on 1 device, data/model "
                             "on 2 or more, hybrid on an even number >= 4")
        if (strategy, n) in out:   # its run directory would be the first's, which it would resume
            raise UsageError(f"--configs lists {part!r} twice: give each configuration once")
        out.append((strategy, n))
    if not out:
        raise UsageError("--configs is empty: e.g. --configs=single:1,data:2")
    return out


def train_command(strategy, n, run_dir, s: dict) -> list[str]:
    """The tf-multigpu-train command line of one configuration."""
    args = [sys.executable, "-m", "tf_multigpu.train", f"--run_dir={run_dir}", f"--strategy={strategy}",
            f"--dataset={s['dataset']}", f"--model={s['model']}", f"--batch_size={s['batch_size']}",
            f"--steps={s['steps']}", f"--eval_every={s['eval_every']}", f"--log_every={s['eval_every']}",
            f"--checkpoint_every={s['steps']}", f"--learning_rate={s['learning_rate']}", f"--seed={s['seed']}"]
    if s["image_size"]:
        args.append(f"--image_size={s['image_size']}")
    if strategy != "single":
        args.append(f"--num_devices={n}")
    if s["cpu_devices"]:
        args.append(f"--cpu_devices={max(s['cpu_devices'], n)}")
    return args


def run_convergence(s: dict) -> list[str]:
    """Trains every configuration, writes convergence.csv/.md/.png; returns their paths."""
    configs = parse_configs(s["configs"])
    import keras  # the progress bar
    os.makedirs(s["out_dir"], exist_ok=True)
    bar = keras.utils.Progbar(len(configs), unit_name="config", stateful_metrics=["test_accuracy"])
    curves = []
    for i, (strategy, n) in enumerate(configs):
        run_dir = os.path.join(s["out_dir"], "runs", f"{strategy}{n}")   # new: tools/convergence.py refuses old runs
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(train_command(strategy, n, run_dir, s), cwd=REPO, capture_output=True, text=True,
                              timeout=s["timeout_s"], env=env)
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise UsageError(f"{strategy} on {n} device(s) failed (exit {done.returncode}): {tail}")
        points = read_test_curve(RunPaths(run_dir).tensorboard)
        with open(RunPaths(run_dir).summary) as f:
            device_word = "GPU" if "GPU" in json.load(f)["devices"][0].upper() else "CPU"
        curves.append({"label": config_label(strategy, n, device_word), "strategy": strategy, "devices": n,
                       "points": points})
        bar.update(i + 1, [("test_accuracy", points[-1]["test_accuracy"] if points else 0.0)])
    paths = [os.path.join(s["out_dir"], name) for name in ("convergence.csv", "convergence.md", "convergence.png")]
    _write_csv(curves, paths[0])
    table = _markdown(curves, s)
    with open(paths[1], "w") as f:
        f.write(table)
    print(table, flush=True)
    _plot(curves, s, paths[2])
    return paths


def read_test_curve(tensorboard_dir: str) -> list[dict]:
    """[{step, wall_s, test_accuracy, test_error, test_loss}] from a run's TensorBoard events;
    wall_s counts from the run's first event."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util
    acc = ea.EventAccumulator(tensorboard_dir, size_guidance={ea.TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()["tensors"]
    if "test/test_accuracy" not in tags:
        return []
    start = min(acc.Tensors(tag)[0].wall_time for tag in tags)
    losses = {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors("test/test_loss")}
    points = []
    for e in acc.Tensors("test/test_accuracy"):
        accuracy = float(tensor_util.make_ndarray(e.tensor_proto))
        points.append({"step": e.step, "wall_s": e.wall_time - start, "test_accuracy": accuracy,
                       "test_error": 1.0 - accuracy, "test_loss": losses.get(e.step)})
    return points


def _write_csv(curves, path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for c in curves:
            for p in c["points"]:
                writer.writerow({"label": c["label"], "strategy": c["strategy"], "devices": c["devices"], **p})


def _markdown(curves, s):
    target = curves[0]["points"][-1]["test_error"] if curves and curves[0]["points"] else None
    lines = [f"## Test error against wall-clock time: {s['model']} on {s['dataset']}, global batch "
             f"{s['batch_size']}, {s['steps']} steps", "",
             "| configuration | final test error | training time (s) | "
             f"time to {curves[0]['label']}'s final error (s) |",
             "| --- | ---: | ---: | ---: |"]
    for c in curves:
        if not c["points"]:
            lines.append(f"| {c['label']} | no evaluation logged | | |")
            continue
        reached = next((p["wall_s"] for p in c["points"] if target is not None and p["test_error"] <= target), None)
        last = c["points"][-1]
        lines.append(f"| {c['label']} | {100 * last['test_error']:.2f}% | {last['wall_s']:.1f} "
                     f"| {'not reached' if reached is None else f'{reached:.1f}'} |")
    return "\n".join(lines) + "\n"


def _plot(curves, s, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in curves:
        ax.plot([p["wall_s"] for p in c["points"]], [100 * p["test_error"] for p in c["points"]], marker=".",
                label=c["label"])
    ax.set_xlabel("wall-clock time since the first step (s)")
    ax.set_ylabel("test error (%)")
    ax.set_yscale("log")
    ax.set_title(f"{s['model']} on {s['dataset']}, global batch {s['batch_size']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
