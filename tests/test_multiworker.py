"""Multi-worker training on localhost: worker processes with logical CPU devices.

2 workers x 2 devices of data parallelism and a batch:2,model:2 mesh over 2 clients end with
the weights of one process with 4 devices; SIGTERM to one worker stops both after the same
step with a checkpoint there, and restarting them ends exactly where an uninterrupted run
does; a killed worker makes the other stop with one line within --peer_timeout; bad cluster
descriptions are one line and exit 2. Every subprocess has a bounded timeout.
"""

import glob
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.conftest import REPO, run_cli
from tests.helpers import checkpoint_values
from tests.launcher import run_module
from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.cluster import resolve_cluster
from tools import launch_local

USAGE_ERROR = 2
STEPS = 80           # long enough that a SIGTERM sent after checkpoint 10 lands mid-run (70 steps left)
COMMON = [f"--steps={STEPS}", "--batch_size=32", "--checkpoint_every=10", "--log_every=2",
          "--eval_every=40", "--seed=3", "--peer_timeout=15"]
RUN_TIMEOUT = 240


def _start_workers(run_dir, tmp_path, flags, workers=2, via="tf_config"):
    """Worker processes as launch_local starts them, each writing to its own log file."""
    commands = launch_local.worker_commands(workers, [f"--run_dir={run_dir}", *COMMON, *flags], via,
                                            launch_local.free_ports(workers))
    procs = []
    for index, (argv, env) in enumerate(commands):
        name = tmp_path / f"{os.path.basename(run_dir)}-w{index}-{time.monotonic_ns()}"
        logs = open(f"{name}.out", "w+"), open(f"{name}.err", "w+")
        procs.append((subprocess.Popen(argv, cwd=REPO, env={**os.environ, **env}, stdout=logs[0],
                                       stderr=logs[1], text=True), logs))
    return procs


def _finish(procs, timeout=RUN_TIMEOUT):
    """(exit status, stdout + stderr, stderr) of every worker; kills them all past the timeout."""
    deadline = time.monotonic() + timeout
    results = []
    for proc, logs in procs:
        try:
            status = proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            status = proc.wait()
        out, err = [log.seek(0) or log.read() for log in logs]
        results.append((status, out + err, err))
    return results


def _wait_for(path_pattern, procs, timeout=RUN_TIMEOUT):
    deadline = time.monotonic() + timeout
    while not glob.glob(path_pattern):
        assert time.monotonic() < deadline, f"{path_pattern} never appeared"
        assert all(p.poll() is None for p, _ in procs), _finish(procs)
        time.sleep(0.05)


def _launch(run_dir, flags, via="tf_config", env=None):
    """python -m tools.launch_local with the common flags; returns CompletedProcess."""
    return run_module("tools.launch_local", "--workers=2", f"--via={via}", f"--timeout={RUN_TIMEOUT}", "--",
                      f"--run_dir={run_dir}", *COMMON, *flags, timeout=RUN_TIMEOUT + 30, env=env)


def _assert_same_weights(run_a, run_b, rtol=1e-5):
    a, b = checkpoint_values(run_a), checkpoint_values(run_b)
    assert a.keys() == b.keys()
    for name in a:   # model, optimizer slots, iteration count, dropout RNG state
        scale = max(float(np.abs(b[name]).max()), 1e-12)
        assert float(np.abs(a[name].astype(np.float64) - b[name]).max()) <= rtol * scale, name


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, 4 logical devices, data parallel."""
    run_dir = str(tmp_path_factory.mktemp("mw") / "one")
    done = run_cli(f"--run_dir={run_dir}", "--strategy=data", "--cpu_devices=4", *COMMON, "--noexport",
                   timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
    return run_dir


# -- the cluster description ----------------------------------------------------------------

@pytest.mark.parametrize("flags, env, needle", [
    (["--worker_hosts=localhost:1234,localhost"], {}, "'localhost' is not HOST:PORT"),
    (["--worker_hosts=localhost:1234,localhost:1234", "--task_index=0"], {}, "names a worker twice"),
    (["--worker_hosts=localhost:1234,localhost:1235"], {}, "--worker_hosts needs --task_index=I"),
    (["--worker_hosts=localhost:1234,localhost:1235", "--task_index=2"], {}, "use 0..1"),
    (["--task_index=1"], {}, "--task_index=1 needs --worker_hosts"),
    (["--strategy=single", "--worker_hosts=a:1,b:2", "--task_index=0"], {}, "--strategy=single runs on one device"),
    (["--peer_timeout=0"], {}, "--peer_timeout=0 must be >= 1"),
    (["--worker_hosts=a:1,b:2", "--task_index=0", "--device_memory_limit=100"], {},
     "--device_memory_limit and --logical_gpus apply to one process, but --worker_hosts describes 2 workers"),
    ([], {"TF_CONFIG": "{not json"}, "TF_CONFIG is not {"),
    ([], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"], "ps": ["b:2"]},
                                   "task": {"type": "worker", "index": 0}})}, "only 'chief' and 'worker'"),
    ([], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                                   "task": {"type": "worker", "index": 5}})}, "is not in its cluster"),
    (["--strategy=single"], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                                                      "task": {"type": "worker", "index": 0}})},
     "TF_CONFIG describes 2 workers"),
])
def test_bad_cluster_is_one_line_exit_2(tmp_path, flags, env, needle):
    done = run_cli(f"--run_dir={tmp_path / 'run'}", *flags, env=env, timeout=120)
    assert done.returncode == USAGE_ERROR, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("tf-multigpu-train: error:")]
    assert len(errors) == 1 and needle in errors[0], done.stderr[-2000:]
    assert not os.path.exists(tmp_path / "run")


def test_cluster_sources():
    assert resolve_cluster(environ={}) is None
    flags = resolve_cluster("h1:1,h2:2", 1, environ={"TF_CONFIG": "ignored: flags win"})
    assert (flags.hosts, flags.task_index, flags.is_chief) == (("h1:1", "h2:2"), 1, False)
    # A TF_CONFIG chief is task 0, the workers follow it.
    tf_config = {"cluster": {"chief": ["c:1"], "worker": ["w:1", "w:2"]}, "task": {"type": "worker", "index": 1}}
    found = resolve_cluster(environ={"TF_CONFIG": json.dumps(tf_config)})
    assert (found.hosts, found.task_index) == (("c:1", "w:1", "w:2"), 2)
    slurm = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "node[1-2]",
             "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    old = dict(os.environ)
    os.environ.update(slurm)   # TensorFlow's resolver reads os.environ itself
    try:
        found = resolve_cluster(environ=os.environ)
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert (found.hosts, found.task_index, found.source) == (("node1:8888", "node2:8888"), 1, "Slurm")
    with pytest.raises(UsageError, match="not HOST:PORT"):
        resolve_cluster("h1:99999,h2:1", 0, environ={})


# -- training across processes --------------------------------------------------------------

@pytest.mark.slow
def test_two_workers_data_parallel_match_one_process(one_process, tmp_path):
    run_dir = str(tmp_path / "data")
    temp = tmp_path / "tmp"   # the workers' own: a test killing a worker may run beside this one
    temp.mkdir()
    done = _launch(run_dir, ["--strategy=data", "--cpu_devices=2"], env={"TMPDIR": str(temp)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "[w0] data parallelism on 4 device(s): /job:worker/replica:0/task:0/device:CPU:0" in done.stdout
    assert "[w1] data parallelism" not in done.stdout   # the chief alone prints the banner
    _assert_same_weights(run_dir, one_process)
    # The chief alone writes the run directory; the other worker's checkpoints are gone.
    assert json.load(open(os.path.join(run_dir, "summary.json")))["step"] == STEPS
    assert len(glob.glob(os.path.join(run_dir, "tensorboard", "events.*"))) == 1
    assert os.path.exists(os.path.join(run_dir, "export", "saved_model.pb"))
    assert not glob.glob(str(temp / "tf_multigpu_worker*"))
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "config.json", "export", "summary.json", "tensorboard"]


@pytest.mark.slow
def test_two_clients_hybrid_mesh_match_one_process(tmp_path):
    flags = ["--strategy=hybrid", "--mesh=batch:2,model:2", f"--steps={STEPS // 4}"]
    one = str(tmp_path / "one")
    done = run_cli(f"--run_dir={one}", "--cpu_devices=4", *COMMON, *flags, "--noexport", timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
    two = str(tmp_path / "two")
    done = _launch(two, ["--cpu_devices=2", *flags], via="flags")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "[w0] hybrid parallelism on 4 device(s)" in done.stdout
    assert "[w1] hybrid parallelism" not in done.stdout   # the chief alone prints the banner
    _assert_same_weights(two, one)
    assert os.path.exists(os.path.join(two, "export", "saved_model.pb"))


@pytest.mark.slow
def test_sigterm_on_one_worker_stops_both_at_one_step_and_resume_is_exact(one_process, tmp_path):
    run_dir = str(tmp_path / "preempted")
    procs = _start_workers(run_dir, tmp_path, ["--strategy=data", "--cpu_devices=2"])
    _wait_for(os.path.join(run_dir, "checkpoints", "ckpt-10.index"), procs)
    procs[1][0].send_signal(signal.SIGTERM)
    results = _finish(procs)
    steps = set()
    for status, output, errors in results:
        assert status == 143, output[-3000:]
        line = [x for x in errors.splitlines() if x.startswith("tf-multigpu-train: error: stopped by SIGTERM")]
        assert len(line) == 1, output[-3000:]
        steps.add(int(line[0].split("after step ")[1].split(",")[0]))
    assert len(steps) == 1, steps   # both workers stopped after the same step
    (stopped,) = steps
    assert 10 < stopped < STEPS
    assert os.path.exists(os.path.join(run_dir, "checkpoints", f"ckpt-{stopped}.index"))
    # Restart both: training goes on from the agreed step to the end, no step lost or repeated.
    done = _launch(run_dir, ["--strategy=data", "--cpu_devices=2"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"steps {stopped}..{STEPS}" in done.stdout
    _assert_same_weights(run_dir, one_process)


@pytest.mark.slow
def test_killed_worker_makes_the_other_fail_with_one_line(tmp_path):
    run_dir = str(tmp_path / "killed")
    procs = _start_workers(run_dir, tmp_path, ["--strategy=data", "--cpu_devices=2"])
    _wait_for(os.path.join(run_dir, "checkpoints", "ckpt-10.index"), procs)
    procs[1][0].kill()
    # --peer_timeout=15, and exiting; a worker still waiting at the deadline is killed (status -9)
    (status, output, errors), _ = _finish(procs, timeout=15 + 60)
    assert status == 1, output[-3000:]
    errors = [x for x in errors.splitlines() if x.startswith("tf-multigpu-train: error:")]
    assert len(errors) == 1 and "lost contact with another worker" in errors[0], output[-3000:]
    assert "restart every worker with the same command" in errors[0]
    assert "Traceback" not in output


def test_lost_peer_errors_are_one_line():
    import tensorflow as tf

    from tf_multigpu.parallel.cluster import describe_peer_failure
    # The texts TensorFlow 2.21 raised here: a killed peer (socket closed / reset), a frozen one.
    texts = {
        "Socket closed": "Graph execution error:\n\nAdditional GRPC error information from remote target "
                         "/job:worker/replica:0/task:1 while calling /tensorflow.WorkerService/RecvBuf:\n"
                         ':UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}',
        "/job:worker/replica:0/task:1 stopped sending heartbeats":
            "{{function_node __f}} Collective ops is aborted by: Error reported from /job:worker/task:1: The "
            "following tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks "
            "have crashed.",
    }
    for reason, text in texts.items():
        line = describe_peer_failure(tf.errors.UnavailableError(None, None, text))
        assert "\n" not in line and f"(UnavailableError: {reason})" in line, line


def test_launcher_prefixes_output_and_fails_when_a_worker_fails(tmp_path):
    done = run_module("tools.launch_local", "--workers=2", "--timeout=120", "--", f"--run_dir={tmp_path / 'run'}",
                      "--peer_timeout=0", timeout=150)
    assert done.returncode == USAGE_ERROR, done.stdout + done.stderr
    for index in (0, 1):
        assert f"[w{index}] tf-multigpu-train: error: --peer_timeout=0 must be >= 1" in done.stdout
        assert f"launch_local: worker {index} exited with status 2" in done.stderr
