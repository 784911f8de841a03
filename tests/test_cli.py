"""The command line: bad input is one line, exit status 2, and destroys nothing;
the default command trains on digits to >= 97% and exports a servable model."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO, run_cli
from tests.helpers import exit_before_tensorflow, serve_digits
from tests.launcher import run_code, run_module
from tf_multigpu.config import Config

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
    (["--batch_size=63", "--run_dir=NEW"],
     "does not divide by the 2 replicas: use a multiple of 2, e.g. --batch_size=62"),
    (["--num_devices=4", "--cpu_devices=2"], "--num_devices=4 but only 2 CPU devices exist"),
    (["--learning_rate=-0.1"], "--learning_rate=-0.1 must be > 0"),
    (["--dataset=tfds:cifar10", "--data_dir=/nonexistent"], "--data_dir=/nonexistent is not a readable directory"),
    (["--dataset=tfds:cifar10", "--data_dir=/tmp", "--run_dir=NEW"], "is not prepared in /tmp"),
    (["--no_such_flag=1"], "Unknown command line flag 'no_such_flag'"),
    (["--batch_size=sixty"], "--batch_size"),
    (["--seed=5"], "holds a run with other settings (--seed: 0 -> 5)"),
    (["--dataset=folder:/nonexistent"], "--dataset=folder:/nonexistent: no such directory"),
    (["--augment=paper"], "--augment=paper applies to photos (--dataset=folder:PATH or tfds:NAME), not digits"),
])
def test_bad_input_is_one_line_exit_2_and_keeps_earlier_results(previous_run, flags, needle):
    before = _fingerprint(previous_run)
    flags = [f"--run_dir={previous_run}_new" if f == "--run_dir=NEW" else f for f in flags]   # not a resume
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


@pytest.mark.parametrize("module", ["tf_multigpu.train", "tf_multigpu.plan_main", "tf_multigpu.export_main",
                                    "tools.benchmark"])
def test_help_is_printed_with_exit_status_0(module):
    """Asking for --help is not a failure (absl alone exits 1), and lists the command's flags."""
    done = run_module(module, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--batch_size" in done.stdout or "--run_dir" in done.stdout, done.stdout[:2000]


@pytest.mark.slow
def test_default_command_learns_digits_and_exports_a_servable_model(default_run):
    # `--run_dir` alone. Its time is not asserted (speed is a benchmark's job, not a test's): the
    # fixture's 180 s timeout only stops a hung run, so a `wall_time_s < 180` here could not fail.
    run_dir, _, summary = default_run
    assert summary["strategy"] == "data" and len(summary["devices"]) == 2
    assert summary["test_accuracy"] >= 0.97
    assert json.load(open(os.path.join(run_dir, "summary.json"))) == summary
    # A fresh process that imports only TensorFlow serves the export: same accuracy.
    [result] = serve_digits([os.path.join(run_dir, "export")])
    assert abs(result["accuracy"] - summary["test_accuracy"]) < 1e-9
    np.testing.assert_allclose(np.sum(result["probabilities"], axis=1), 1.0, atol=1e-5)



# -- a quiet start ---------------------------------------------------------------------------

_NO_GPU_STARTUP = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796077838.587269    1832 port.cc:153] oneDNN custom operations are on. You may see ...
I0000 00:00:1796077838.587614    1832 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU ...
I0000 00:00:1796078007.033199    3947 cpu_feature_guard.cc:227] This TensorFlow binary is optimized ...
To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow ...
E0000 00:00:1796077841.977286    1832 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: ...
W0000 00:00:1796077841.977286    1832 something.cc:1] a warning
E0000 00:00:1796077841.977286    1832 something.cc:2] a real error
a line of our own
"""


@pytest.mark.parametrize("level, ours, expected", [
    (2, True, ["a real error", "a line of our own"]),          # our default: errors, minus cuInit without a GPU
    (1, False, ["failed call to cuInit", "a warning", "a real error", "a line of our own"]),   # the user's level
    (0, False, ["InitializeLog", "oneDNN", "cuda drivers", "optimized", "To enable", "cuInit", "a warning",
                "a real error", "a line of our own"]),
])
def test_start_up_logging_is_filtered_to_the_log_level(monkeypatch, capfd, level, ours, expected):
    from tf_multigpu import cli
    monkeypatch.setattr(cli, "nvidia_device_present", lambda: False)
    with cli._stderr_filtered(lambda line: cli._shown(line, level, ours)):
        os.write(2, _NO_GPU_STARTUP.encode())
    shown = capfd.readouterr().err.splitlines()
    assert len(shown) == len(expected) and all(e in line for e, line in zip(expected, shown)), shown


def test_cuinit_failing_with_an_nvidia_device_is_shown(monkeypatch):
    from tf_multigpu import cli
    monkeypatch.setattr(cli, "nvidia_device_present", lambda: True)
    assert cli._shown("E0000 00:00:1.0 1 cuda_platform.cc:52] failed call to cuInit: INTERNAL\n", 2, True)


_BROKEN_BEFORE_TRAINING = """
from tf_multigpu import train
def broken():
    raise RuntimeError("a broken install")
train.run_flags.config_from_flags = broken
train.main(["tf-multigpu-train"])
"""


def test_an_unexpected_error_before_training_is_raised_as_itself():
    """Not as an UnboundLocalError of an exception class imported later in main's try block.
    In its own process: the training flags must not be defined in the test process (tools'
    modules loaded there define some of the same names)."""
    done = run_code(_BROKEN_BEFORE_TRAINING, timeout=120)
    assert done.returncode == 1 and done.stderr.rstrip().endswith("RuntimeError: a broken install"), done.stderr
    assert "UnboundLocalError" not in done.stderr and "During handling" not in done.stderr


def _clean_env():
    """The user's environment: no log level of ours or of the test set-up."""
    return {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_MULTIGPU_QUIET")}


@pytest.mark.slow
def test_a_usage_error_prints_exactly_one_line_tensorflow_start_up_included(tmp_path):
    # the model is looked up after TensorFlow started (its factories import Keras): its
    # start-up lines are held back too
    done = subprocess.run([sys.executable, "-m", "tf_multigpu.train", f"--run_dir={tmp_path / 'X'}",
                           "--model=resnet", "--cpu_devices=2"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=_clean_env())
    assert done.returncode == USAGE_ERROR
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "tf-multigpu-train: error: unknown --model='resnet': choose one of alexnet, small_convnet, "
        "or package.module:function"], done.stderr


@pytest.mark.parametrize("flags, message", [
    (["--batch_size=7", "--cpu_devices=2"], "does not divide by the 2 replicas"),
    (["--strategy=hybrid", "--cpu_devices=4", "--mesh=batch:4,model:1"], "needs both mesh axes > 1"),
    (["--num_devices=4", "--cpu_devices=2"], "--num_devices=4 but only 2 CPU devices exist: use --cpu_devices>=4"),
    (["--strategy=single", "--worker_hosts=a:1,b:2", "--task_index=0"], "--strategy=single runs on one device"),
    (["--model=resnet"], "unknown --model='resnet': choose one of alexnet, small_convnet"),
    (["--run_dir=FILE"], "is a file, not a directory: give a directory path"),
    (["--run_dir=RUN", "--seed=5"], "holds a run with other settings (--seed: 0 -> 5)"),
    (["--dataset=tfds:cifar10", "--data_dir=~/no_such_dir"], f"--data_dir={os.path.expanduser('~')}/no_such_dir "),
    (["--flagfile=flags/paper_1gpu.flags", "--flagfile=no_such.flags"], "run from the repository root"),
])
def test_what_the_flags_decide_is_refused_before_tensorflow_starts(tmp_path, flags, message):
    """The plan on --cpu_devices devices and the cluster are checked before TensorFlow is
    imported: a mistyped mesh costs a fraction of a second, not the runtime's start-up."""
    if "--run_dir=RUN" in flags:   # a run directory holding another run's config
        (tmp_path / "RUN").mkdir()
        (tmp_path / "RUN" / "config.json").write_text(Config(run_dir=str(tmp_path / "RUN")).to_json())
        flags = [f"--run_dir={tmp_path / 'RUN'}" if f == "--run_dir=RUN" else f for f in flags]
    if "--run_dir=FILE" in flags:
        (tmp_path / "FILE").write_text("")
        flags = [f"--run_dir={tmp_path / 'FILE'}" if f == "--run_dir=FILE" else f for f in flags]
    status, imported, line = exit_before_tensorflow("tf_multigpu.train", "tf-multigpu-train",
                                                    f"--run_dir={tmp_path / 'X'}", *flags)
    assert (status, imported) == (USAGE_ERROR, False), line
    assert line.startswith("tf-multigpu-train: error: ") and message in line, line


@pytest.mark.slow
def test_ctrl_c_stops_after_a_checkpoint_with_one_line_and_status_130(tmp_path):
    """Ctrl-C (SIGINT) had given a KeyboardInterrupt traceback and lost every step since the
    last periodic checkpoint; now it stops like a preemption, at a step with a checkpoint."""
    run_dir = str(tmp_path / "run")
    argv = [sys.executable, "-m", "tf_multigpu.train", f"--run_dir={run_dir}", "--steps=100000",
            "--checkpoint_every=100000", "--log_every=5", "--eval_every=100000", "--noexport", "--cpu_devices=2"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:   # the banner: training has started
            if "parallelism on" in line:
                break
        time.sleep(3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("tf-multigpu-train: error:")]
    assert len(errors) == 1 and "stopped by SIGINT after step " in errors[0], err[-2000:]
    step = int(errors[0].split("after step ")[1].split(",")[0])
    assert step >= 5 and os.path.exists(os.path.join(run_dir, "checkpoints", f"ckpt-{step}.index"))

