"""Runs a multi-worker training job on this machine: N worker processes on localhost.

    python -m tools.launch_local --workers=2 -- --run_dir=runs/mw --strategy=data --cpu_devices=2
    python -m tools.launch_local --workers=2 --via=flags -- --run_dir=runs/hy --strategy=hybrid \\
        --mesh=batch:2,model:2 --cpu_devices=2

Everything after `--` is the tf-multigpu-train command line, the same for every worker. Free
ports are picked here; each worker gets its place through TF_CONFIG (`--via=tf_config`, the
default) or `--worker_hosts/--task_index` (`--via=flags`), exactly as on a real cluster. Each
worker's output lines are prefixed with `[wI]`. SIGTERM or Ctrl-C here is passed on to every
worker (which then save a checkpoint at a step they agree on and stop). The exit status is
0 if every worker succeeded, else the first failing worker's status.

For trying multi-worker training on one machine, not for speed: the workers share its cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

from absl import flags

from tf_multigpu import cli

PROG = "launch_local"

flags.DEFINE_integer("workers", 2, "Number of worker processes.")
flags.DEFINE_enum("via", "tf_config", ["tf_config", "flags"],
                  "How each worker learns the cluster: TF_CONFIG or --worker_hosts/--task_index.")
flags.DEFINE_float("timeout", None, "Kill every worker after this many seconds (default: wait).")
FLAGS = flags.FLAGS


def free_ports(count: int) -> list[int]:
    """Ports that are free now (bound together, so they are distinct)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("localhost", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def worker_commands(num_workers: int, train_args: list[str], via: str, ports: list[int]):
    """(argv, extra environment) of every worker."""
    hosts = [f"localhost:{p}" for p in ports]
    commands = []
    for index in range(num_workers):
        argv = [sys.executable, "-m", "tf_multigpu.train", *train_args]
        env = {}
        if via == "flags":
            argv += [f"--worker_hosts={','.join(hosts)}", f"--task_index={index}"]
        else:
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts}, "task": {"type": "worker", "index": index}})
        commands.append((argv, env))
    return commands


def _pump(prefix: str, stream, out):
    for line in stream:
        out.write(f"{prefix} {line}")
        out.flush()


def launch(num_workers: int, train_args: list[str], via: str = "tf_config", timeout: float | None = None) -> int:
    """Starts the workers, waits for all of them; returns 0 or the first failure's status."""
    commands = worker_commands(num_workers, train_args, via, free_ports(num_workers))
    procs, pumps = [], []
    for index, (argv, env) in enumerate(commands):
        # A session of its own: a Ctrl-C at the terminal reaches the launcher alone, which passes
        # it on once. In the terminal's process group every worker got it twice (the terminal's,
        # then the launcher's), which the second time stops a worker without its checkpoint.
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(f"[w{index}]", proc.stdout, sys.stdout), daemon=True)
        pump.start()
        pumps.append(pump)

    def forward(signum, frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        statuses = [proc.wait(timeout=timeout) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        print(f"launch_local: workers still running after {timeout}s: killed", file=sys.stderr)
        return 124
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for pump in pumps:
            pump.join(timeout=5)
    failed = [(i, s) for i, s in enumerate(statuses) if s != 0]
    for index, status in failed:
        print(f"launch_local: worker {index} exited with status {status}", file=sys.stderr)
    return failed[0][1] if failed else 0


def main(argv):
    train_args = argv[1:]   # everything after `--`
    if FLAGS.workers < 1:
        cli.fail(PROG, f"--workers={FLAGS.workers} must be >= 1")
    if FLAGS.timeout is not None and FLAGS.timeout <= 0:
        cli.fail(PROG, f"--timeout={FLAGS.timeout:g} must be > 0 seconds (leave it out to wait for the workers)")
    if any(a.startswith(("--worker_hosts", "--task_index")) for a in train_args):
        cli.fail(PROG, "the launcher sets --worker_hosts and --task_index itself: drop them")
    sys.exit(launch(FLAGS.workers, train_args, FLAGS.via, FLAGS.timeout))


def run():
    """Entry point: `python -m tools.launch_local [--workers=N] [--via=...] -- TRAIN_FLAGS`."""
    cli.run(main, PROG)


if __name__ == "__main__":
    run()
