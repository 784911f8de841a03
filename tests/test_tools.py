"""Every command of the package speaks alike: a bad flag is one line on stderr and exit 2,
decided before any TensorFlow work (so this file runs in seconds: every command starts in a
parallel subprocess); and the workload flags mean the same everywhere."""

import glob
import json
import os
import subprocess
import sys

import pytest
from absl import flags

from tests.conftest import REPO
from tf_multigpu import cli
from tf_multigpu.config.workload_flags import WORKLOAD_FLAGS, check_workload_flags, define_workload_flags
from tf_multigpu.errors import UsageError

COMMANDS = ["tf_multigpu.train", "tf_multigpu.plan_main", "tf_multigpu.export_main"] + sorted(
    "tools." + os.path.basename(path)[:-3] for path in glob.glob(os.path.join(REPO, "tools", "*.py"))
    if not path.endswith("__init__.py"))


def _start(module, *args):
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def bad_flag_runs():
    """Every command run with an unknown flag, all at once."""
    procs = {module: _start(module, "--no_such_flag=1") for module in COMMANDS}
    return {module: (proc.wait(timeout=120), *proc.communicate()) for module, proc in procs.items()}


def test_every_tool_is_listed():
    assert {"tools.benchmark", "tools.convergence", "tools.max_batch", "tools.comm_report",
            "tools.launch_local"} <= set(COMMANDS)


@pytest.mark.parametrize("module", COMMANDS)
def test_a_bad_flag_is_one_line_and_exit_2(bad_flag_runs, module):
    status, out, err = bad_flag_runs[module]
    prog = module.split(".")[-1]
    assert status == 2, err
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].endswith("error: Unknown command line flag 'no_such_flag' (see --help)"), err
    assert prog.replace("_main", "") in lines[0].replace("-", "_"), err


def test_no_tool_patches_sys_path():
    for path in glob.glob(os.path.join(REPO, "tools", "**", "*.py"), recursive=True):
        assert "sys.path" not in open(path).read(), f"{path}: run it as python -m tools.NAME instead"


def test_workload_flags_have_one_definition_and_one_check():
    values = flags.FlagValues()
    names = define_workload_flags(flag_values=values, batch_size=256, dataset="synthetic")
    assert names == WORKLOAD_FLAGS
    values(["prog"])
    assert (values.batch_size, values.dataset, values.model) == (256, "synthetic", "small_convnet")
    values(["prog", "--batch_size=0"])
    with pytest.raises(UsageError, match=r"--batch_size=0 must be >= 1"):
        check_workload_flags(values)
    with pytest.raises(ValueError, match="not workload flags"):
        define_workload_flags(("steps",), flag_values=flags.FlagValues())


@pytest.mark.parametrize("flag, message", [
    ("--rounds=0", "--rounds=0: give at least 1"),
    ("--seconds=-1", "--seconds=-1: give 0 (--steps alone) or more"),
])
def test_plan_vs_measured_refuses_a_bad_count_before_it_measures(flag, message):
    done = subprocess.run([sys.executable, "-m", "tools.plan_vs_measured", flag], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [f"plan_vs_measured: error: {message}"]


def _bad_value_cases(root):
    """(module, args, the one line's needle) for values each tool must refuse in one line."""
    earlier = os.path.join(root, "earlier")
    os.makedirs(earlier)
    for name in ("results.csv", "plan.md", "max_batch.json", "table.md"):
        open(os.path.join(earlier, name), "w").close()
    os.makedirs(os.path.join(earlier, "runs"))
    a_file = os.path.join(root, "a_file")
    open(a_file, "w").close()
    profile = os.path.join(root, "negative.json")
    with open(os.path.join(REPO, "tf_multigpu", "planner", "profiles", "titan_pcie3.json")) as f:
        values = {**json.load(f), "peak_flops_per_s": -1}
    with open(profile, "w") as f:
        json.dump(values, f)
    return [
        ("tools.input_throughput", ["--batch_size=0"], "--batch_size=0 must be >= 1"),
        ("tools.input_throughput", ["--sources=folder", "--folder_shape=abc"],
         "--folder_shape=abc must be HEIGHT,WIDTH"),
        ("tools.input_throughput", ["--sources=folder", "--folder_images=64"], "the written folder needs at least 100"),
        ("tools.input_throughput", ["--sources=folder", f"--folder={root}/none", "--seconds=1"], "no such directory"),
        ("tools.benchmark", ["--smoke", f"--out_dir={root}/new", "--repeats=0"], "--repeats=0 must be >= 1"),
        ("tools.benchmark", ["--smoke", f"--out_dir={earlier}"], "holds an earlier run's results (results.csv)"),
        ("tools.benchmark", ["--smoke", f"--out_dir={a_file}"], "is a file: give a directory"),
        ("tools.memory_table", [f"--out={earlier}"], "is a directory: give a file name"),
        ("tools.memory_table", ["--train_steps=0"], "--train_steps=0 must be >= 1"),
        ("tools.memory_table", [f"--out={earlier}/table.md"], "table.md hold an earlier run's table"),
        ("tools.max_batch", ["--device_memory_limit=100", f"--out_dir={earlier}"],
         "holds an earlier run's results (max_batch.json)"),
        ("tools.convergence", [f"--out_dir={earlier}"], "holds an earlier run's results (runs)"),
        ("tools.convergence", [f"--out_dir={root}/new", "--configs=data:2,data:2"], "lists 'data:2' twice"),
        *([] if cli.nvidia_device_present() else [("tools.memory_table", ["--gpus"], "has no NVIDIA GPU")]),
        ("tools.launch_local", ["--timeout=-3", "--", "--steps=1"], "--timeout=-3 must be > 0 seconds"),
        ("tools.convergence", [f"--out_dir={root}/new", "--batch_size=30", "--configs=single:1,data:4"],
         "--batch_size=30 does not divide by the 4 replicas of data:4"),
        ("tf_multigpu.plan_main", [f"--profile={profile}"], "peak_flops_per_s=-1 must be a number > 0"),
        ("tf_multigpu.plan_main", ["--profile=titan_pcie3", f"--out_dir={earlier}"],
         "holds an earlier run's results (plan.md)"),
    ]


def test_bad_values_are_one_line_exit_2_and_keep_earlier_results(tmp_path):
    """Values each tool used to take to a traceback (exit 1), a meaningless run (exit 0) or an
    earlier run's results replaced without a word."""
    cases = _bad_value_cases(str(tmp_path))
    procs = [(case, _start(case[0], *case[1])) for case in cases]
    for (module, args, needle), proc in procs:
        out, err = proc.communicate(timeout=300)
        lines = [line for line in err.splitlines() if ": error: " in line]
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], (module, args, err[-1500:])
        assert err.rstrip().endswith(lines[0]), (module, args, err[-1500:])
    assert sorted(os.listdir(tmp_path / "earlier")) == ["max_batch.json", "plan.md", "results.csv", "runs", "table.md"]
