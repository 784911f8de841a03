"""Every command of the package speaks alike: a bad flag is one line on stderr and exit 2,
decided before any TensorFlow work (so this file runs in seconds: every command starts in a
parallel subprocess); and the workload flags mean the same everywhere."""

import glob
import os
import subprocess
import sys

import pytest
from absl import flags

from tests.conftest import REPO
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
