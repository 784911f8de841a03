"""Runs a list of BenchRuns, each in a fresh `python -m tools.bench.worker` process.

A fresh process per configuration is required, not a nicety: logical devices can only be
configured before TensorFlow starts, and a second DTensor mesh in one process can hang.
Runs go one at a time (concurrent runs would share the cores and spoil each other's timing)
under a progress bar. A run that fails (a batch too large for memory, a missing peer)
becomes a row with its error; the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torch_available() -> bool:
    """Whether PyTorch is importable (checked without importing it: it is large)."""
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def run_all(runs, data_shapes: dict, timeout_s: float, log=None, repeats: int = 1) -> list[dict]:
    """One result row per run, in order. `data_shapes[(dataset, image_size)]` gives the torch
    peer the input shape and class count; `log` (a file) receives each worker's stderr.

    With `repeats` > 1 the whole list runs again, round after round, and each row pools the
    step times of all its rounds: on a shared machine a burst of load then spoils one round
    of every configuration a little instead of one configuration a lot.
    """
    import keras  # the progress bar; TensorFlow itself never starts devices in this process
    bar = keras.utils.Progbar(len(runs) * repeats, stateful_metrics=["images/s"], unit_name="config")
    results = [None] * len(runs)
    for round_ in range(repeats):
        for i, run in enumerate(runs):
            result = run_one(run, data_shapes.get((run.dataset, run.image_size)), timeout_s, log)
            results[i] = result if results[i] is None else _pool(results[i], result)
            times = result.get("step_times_s") or []
            rate = run.batch * len(times) / sum(times) if times else 0.0
            bar.update(round_ * len(runs) + i + 1, [("images/s", rate)])
    return [{**dataclasses.asdict(run), "mesh": run.mesh, "repeats": repeats, **result}
            for run, result in zip(runs, results)]


def _pool(first: dict, later: dict) -> dict:
    """Step times of both rounds; a round that failed makes the row fail."""
    if first.get("error") or later.get("error"):
        return {**first, "error": first.get("error") or later.get("error")}
    return {**first, "step_times_s": first["step_times_s"] + later["step_times_s"]}


def run_one(run, data_shape, timeout_s: float, log=None) -> dict:
    """The worker's JSON result for one run, or {"error": ...}."""
    if run.kind == "torch_ddp" and not torch_available():
        return {"error": "torch not installed (pip install -e '.[torch]')"}
    args = [sys.executable, "-m", "tools.bench.worker", run.to_json()]
    if data_shape:
        args.append(json.dumps(data_shape))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s (raise --timeout_s, or fewer --timed_steps)"}
    if log is not None:
        log.write(f"==== {run.to_json()}\n{done.stderr}\n")
        log.flush()
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"worker exited {done.returncode}: {tail}"[:300]}
