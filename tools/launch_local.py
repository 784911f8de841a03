"""Runs a multi-worker training job on this machine: N worker processes on localhost.

    python tools/launch_local.py --workers=2 -- --run_dir=runs/mw --strategy=data --cpu_devices=2
    python tools/launch_local.py --workers=2 --via=flags -- --run_dir=runs/hy --strategy=hybrid \\
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

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading


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


def run(num_workers: int, train_args: list[str], via: str = "tf_config", timeout: float | None = None) -> int:
    """Starts the workers, waits for all of them; returns 0 or the first failure's status."""
    commands = worker_commands(num_workers, train_args, via, free_ports(num_workers))
    procs, pumps = [], []
    for index, (argv, env) in enumerate(commands):
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="launch_local.py [--workers=N] [--via=tf_config|flags] -- TRAIN_FLAGS")
    parser.add_argument("--workers", type=int, default=2, help="number of worker processes (default 2)")
    parser.add_argument("--via", choices=("tf_config", "flags"), default="tf_config",
                        help="how each worker learns the cluster: TF_CONFIG or --worker_hosts/--task_index")
    parser.add_argument("--timeout", type=float, default=None, help="kill every worker after this many seconds")
    args = parser.parse_args(ours)
    if args.workers < 1:
        parser.error(f"--workers={args.workers} must be >= 1")
    if any(a.startswith(("--worker_hosts", "--task_index")) for a in train_args):
        parser.error("the launcher sets --worker_hosts and --task_index itself: drop them")
    return run(args.workers, train_args, args.via, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
