"""The command line: bad input is one line, exit status 2, and destroys nothing;
the default command trains on digits to >= 97% and exports a servable model."""

import hashlib
import json
import os

import numpy as np
import pytest

from tests.conftest import run_cli
from tests.helpers import serve_digits

USAGE_ERROR = 2


def _fingerprint(root):
    """Every file under root with its content hash: proves a failed run changed nothing."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def previous_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("cli") / "run")
    done = run_cli(f"--run_dir={run_dir}", "--steps=3", "--cpu_devices=2")
    assert done.returncode == 0, done.stderr[-2000:]
    return run_dir


@pytest.mark.parametrize("flags, needle", [
    (["--model=resnet"], "unknown --model='resnet': choose one of alexnet, small_convnet"),
    (["--dataset=mnist"], "unknown --dataset='mnist': choose one of digits, synthetic, tfds:NAME"),
    (["--strategy=pipeline"], "unknown --strategy='pipeline': choose one of single, data"),
    (["--batch_size=63"], "does not divide by the 2 replicas: use a multiple of 2, e.g. --batch_size=62"),
    (["--num_devices=4", "--cpu_devices=2"], "--num_devices=4 but only 2 CPU devices exist"),
    (["--learning_rate=-0.1"], "--learning_rate=-0.1 must be > 0"),
    (["--dataset=tfds:cifar10", "--data_dir=/nonexistent"], "--data_dir=/nonexistent is not a readable directory"),
    (["--dataset=tfds:cifar10", "--data_dir=/tmp"], "is not prepared in /tmp"),
    (["--no_such_flag=1"], "Unknown command line flag 'no_such_flag'"),
    (["--batch_size=sixty"], "--batch_size"),
    (["--seed=5"], "holds a run with other settings (--seed: 0 -> 5)"),
    (["--dataset=folder:/nonexistent"], "--dataset=folder:/nonexistent: no such directory"),
    (["--augment=paper"], "--augment=paper applies to photos (--dataset=folder:PATH or tfds:NAME), not digits"),
])
def test_bad_input_is_one_line_exit_2_and_keeps_earlier_results(previous_run, flags, needle):
    before = _fingerprint(previous_run)
    done = run_cli(f"--run_dir={previous_run}", *flags)
    assert done.returncode == USAGE_ERROR, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("tf-multigpu-train: error:")]
    assert len(errors) == 1 and needle in errors[0], done.stderr[-2000:]
    assert done.stderr.rstrip().endswith(errors[0])
    assert _fingerprint(previous_run) == before


def test_a_factory_that_builds_no_keras_model_is_one_line_naming_it(tmp_path):
    done = run_cli(f"--run_dir={tmp_path / 'run'}", "--model=os:getcwd", "--steps=1")
    assert done.returncode == USAGE_ERROR
    assert done.stderr.strip().splitlines()[-1].startswith(
        "tf-multigpu-train: error: --model=os:getcwd: the factory raised TypeError")
    assert "Traceback" not in done.stderr


def test_missing_run_dir():
    done = run_cli()
    assert done.returncode == USAGE_ERROR
    assert "--run_dir is required" in done.stderr


@pytest.mark.slow
def test_default_command_learns_digits_and_exports_a_servable_model(tmp_path):
    run_dir = str(tmp_path / "quickstart")
    done = run_cli(f"--run_dir={run_dir}", timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["strategy"] == "data" and len(summary["devices"]) == 2
    assert summary["test_accuracy"] >= 0.97
    assert summary["wall_time_s"] < 180
    assert json.load(open(os.path.join(run_dir, "summary.json"))) == summary
    # A fresh process that imports only TensorFlow serves the export: same accuracy.
    [result] = serve_digits([os.path.join(run_dir, "export")])
    assert abs(result["accuracy"] - summary["test_accuracy"]) < 1e-9
    np.testing.assert_allclose(np.sum(result["probabilities"], axis=1), 1.0, atol=1e-5)

