"""The test launcher (tests/launcher.py): a command forked from its server ends as the same
command in a fresh process does (output, exit status, arguments, directory, environment), and
one that overruns its timeout is killed."""

import os
import subprocess
import sys

import pytest

from tests import launcher

_REPORT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "var": os.environ.get("LAUNCHER_TEST_VAR"),
                  "tensorflow_started": "tensorflow" in sys.modules}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("status", [0, 3])
def test_a_forked_command_ends_as_a_fresh_one(tmp_path, status):
    args = (str(status), "--flag=1")
    forked = launcher.run_code(_REPORT, *args, cwd=tmp_path, env={"LAUNCHER_TEST_VAR": "x"})
    fresh = subprocess.run([sys.executable, "-c", _REPORT, *args], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "LAUNCHER_TEST_VAR": "x"}, timeout=60)
    assert forked.returncode == fresh.returncode == status
    assert forked.stderr == fresh.stderr == "to stderr\n"
    # The same output, but for what the launcher is for: TensorFlow was imported already.
    assert '"tensorflow_started": true' in forked.stdout and '"tensorflow_started": false' in fresh.stdout
    assert forked.stdout.replace('"tensorflow_started": true', '"tensorflow_started": false') == fresh.stdout


def test_a_forked_module_sees_the_argv_and_path_python_m_gives(tmp_path):
    # The module lives in a directory of its own, not in the repository, where the tests that
    # read every source file (test_compat) might meet it half-deleted.
    (tmp_path / "_launcher_probe.py").write_text("import json, sys; print(json.dumps([sys.argv, sys.path[0]]))\n")
    forked = launcher.run_module("_launcher_probe", "--x=1", cwd=tmp_path)
    fresh = subprocess.run([sys.executable, "-m", "_launcher_probe", "--x=1"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    assert forked.returncode == fresh.returncode == 0, forked.stderr + fresh.stderr
    assert forked.stdout == fresh.stdout


def test_an_uncaught_exception_exits_1_with_its_traceback():
    done = launcher.run_code("raise ValueError('boom')")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "ValueError: boom"


def test_a_command_past_its_timeout_is_killed(tmp_path):
    marker = tmp_path / "pids"
    code = ("import os, subprocess, sys, time\n"
            "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(marker)!r}, 'w').write(f'{{os.getpid()}} {{grandchild.pid}}')\n"
            "time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        launcher.run_code(code, timeout=5)
    pid, grandchild = map(int, marker.read_text().split())
    with pytest.raises(ProcessLookupError):   # gone, and reaped by the server
        os.kill(pid, 0)
    # The run it started was killed too (a zombie until init reaps it: its state is Z).
    try:
        state = open(f"/proc/{grandchild}/stat").read().split(")")[-1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("Z", "gone"), state
    assert launcher.run_code("print('next')").stdout == "next\n"   # the server serves on
