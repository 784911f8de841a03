"""Which processes make up a multi-worker run, and starting TensorFlow's distributed runtime.

The same command runs on every host; each process learns the cluster (every worker's
host:port, in task order) and its own place in it from, in this order:
1. `--worker_hosts=h1:p,h2:p --task_index=i`;
2. `TF_CONFIG` (a `chief` job, if any, comes first: task 0 is the chief);
3. Slurm (`SLURM_PROCID`, `SLURM_STEP_*`, more than one task), through TensorFlow's
   `SlurmClusterResolver`.
Without any of them the run is one process, as before.

Task 0 is the chief: it alone writes the run directory's shared files. The runtime must be
started before anything initialises TensorFlow's context (listing devices does), so
`start_runtime` is the first TensorFlow call of a clustered run: it makes the logical CPU
devices, then either creates the `MultiWorkerMirroredStrategy` (`--strategy=data`) or sets
DTensor's multi-client environment variables and initialises DTensor (`model`, `hybrid`).
Both run TensorFlow's coordination service, with a heartbeat timeout of `--peer_timeout`
seconds, so a dead peer turns into an error on the survivors instead of a hang.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import shutil

from tf_multigpu.errors import UsageError

JOB = "worker"
_MAX_TASKS_PER_NODE = 1024
_HOST_PORT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:(\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Every worker's host:port in task order, and this process's task index."""

    hosts: tuple
    task_index: int
    source: str   # where it came from, for messages: --worker_hosts, TF_CONFIG or Slurm

    @property
    def num_workers(self) -> int:
        return len(self.hosts)

    @property
    def is_chief(self) -> bool:
        return self.task_index == 0

    def cluster_spec_dict(self) -> dict:
        return {JOB: list(self.hosts)}


def resolve_cluster(worker_hosts: str = "", task_index: int | None = None,
                    environ=os.environ, start_tensorflow=None) -> Cluster | None:
    """The cluster this process belongs to, or None for a single-process run.

    `start_tensorflow`: how the entry point starts TensorFlow (quietly: cli.start_tensorflow),
    for Slurm's resolver, the one source that needs it; plain `import tensorflow` if None."""
    if worker_hosts:   # (--task_index without --worker_hosts: Config.validate refuses it)
        return _from_flags(worker_hosts, task_index)
    if environ.get("TF_CONFIG"):
        return _from_tf_config(environ["TF_CONFIG"])
    if int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1")) or 1) > 1:
        return _from_slurm(start_tensorflow or (lambda: importlib.import_module("tensorflow")))
    return None


def parse_worker_hosts(text: str) -> tuple:
    """`h1:p1,h2:p2` -> ('h1:p1', 'h2:p2'), or a one-line usage error."""
    hosts = tuple(h.strip() for h in text.split(","))
    for host in hosts:
        match = _HOST_PORT.match(host)
        if not match or not 0 < int(match.group(1)) < 65536:
            raise UsageError(f"--worker_hosts={text!r}: {host!r} is not HOST:PORT "
                             "(e.g. --worker_hosts=node1:12345,node2:12345)")
    if len(set(hosts)) != len(hosts):
        raise UsageError(f"--worker_hosts={text!r} names a worker twice: give each worker its own HOST:PORT")
    return hosts


def _from_flags(worker_hosts: str, task_index: int | None) -> Cluster:
    hosts = parse_worker_hosts(worker_hosts)
    if task_index is None:
        raise UsageError("--worker_hosts needs --task_index=I: this worker's position in the list (0 is the chief)")
    if not 0 <= task_index < len(hosts):
        raise UsageError(f"--task_index={task_index} is not a position in --worker_hosts "
                         f"({len(hosts)} workers): use 0..{len(hosts) - 1}")
    return Cluster(hosts, task_index, "--worker_hosts")


def _from_tf_config(text: str) -> Cluster:
    try:
        tf_config = json.loads(text)
        cluster, task = tf_config["cluster"], tf_config["task"]
        task_type, index = task["type"], int(task["index"])
        chiefs, workers = list(cluster.get("chief", [])), list(cluster.get("worker", []))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"TF_CONFIG is not {{\"cluster\": {{\"worker\": [HOST:PORT, ...]}}, \"task\": "
                         f"{{\"type\": \"worker\", \"index\": I}}}} ({type(e).__name__}: {e})") from None
    others = sorted(set(cluster) - {"chief", "worker"})
    if others or task_type not in ("chief", "worker"):
        raise UsageError(f"TF_CONFIG has jobs {sorted(cluster)} and task type {task_type!r}: only 'chief' "
                         "and 'worker' are supported (synchronous training has no ps or evaluator)")
    if len(chiefs) > 1:
        raise UsageError(f"TF_CONFIG names {len(chiefs)} chiefs: give at most one")
    hosts = parse_worker_hosts(",".join(chiefs + workers))
    position = index if task_type == "chief" else len(chiefs) + index
    if task_type == "chief" and index != 0 or not 0 <= position < len(hosts):
        raise UsageError(f"TF_CONFIG task {task_type}:{index} is not in its cluster {cluster}")
    return Cluster(hosts, position, "TF_CONFIG")


def _from_slurm(start_tensorflow, port_base: int = 8888) -> Cluster:
    tf = start_tensorflow()   # the entry point resolves the cluster before it starts TensorFlow
    SlurmClusterResolver = tf.distribute.cluster_resolver.SlurmClusterResolver
    try:
        if shutil.which("nvidia-smi"):   # GPUs: the resolver gives each task its share
            resolver = SlurmClusterResolver(port_base=port_base)
        else:
            # The resolver assumes GPUs: without nvidia-smi it fails, with gpus_per_node=0 it
            # fails with "range() arg 3 must not be zero". A nominal GPU per task, not
            # applied (auto_set_gpu=False), resolves CPU-only nodes.
            resolver = SlurmClusterResolver(port_base=port_base, gpus_per_node=_MAX_TASKS_PER_NODE,
                                            gpus_per_task=1, auto_set_gpu=False)
        spec = resolver.cluster_spec().as_dict()
    except (RuntimeError, KeyError, ValueError) as e:
        raise UsageError(f"cannot read the Slurm allocation ({e}): run under srun, or give "
                         "--worker_hosts and --task_index") from None
    return Cluster(tuple(spec[JOB]), int(resolver.task_id), "Slurm")


# -- the distributed runtime -----------------------------------------------------------------

@dataclasses.dataclass
class Runtime:
    """A started multi-worker runtime: this worker's place, its devices, and (data) the strategy."""

    cluster: Cluster
    local_devices: list          # this worker's devices, full names
    strategy: object = None      # the MultiWorkerMirroredStrategy of --strategy=data

    @property
    def is_chief(self) -> bool:
        return self.cluster.is_chief

    @property
    def all_devices(self) -> list:
        """Every device of the cluster, worker by worker (the order of replicas and mesh ids)."""
        names = []
        for task in range(self.cluster.num_workers):
            names += [f"/job:{JOB}/replica:0/task:{task}/device:{d.split('device:')[-1]}"
                      for d in self.local_devices]
        return names


def start_runtime(cluster: Cluster, strategy: str, cpu_devices: int, num_devices: int,
                  peer_timeout: int) -> Runtime:
    """Starts TensorFlow's distributed runtime for this worker (first TensorFlow call)."""
    import tensorflow as tf
    device_type = _configure_local_devices(tf, cpu_devices, num_devices)
    _configure_coordination(cluster, peer_timeout)
    if strategy == "data":
        from tf_multigpu.parallel.multi_worker import make_multi_worker_strategy
        mwms = make_multi_worker_strategy(cluster, device_type, cpu_devices or 0)
        local = list(mwms.extended.worker_devices)
    else:
        from tensorflow.experimental import dtensor
        os.environ.update(DTENSOR_CLIENT_ID=str(cluster.task_index), DTENSOR_NUM_CLIENTS=str(cluster.num_workers),
                          DTENSOR_JOB_NAME=JOB, DTENSOR_JOBS=",".join(cluster.hosts))
        # Our coordination settings (heartbeat timeout) stand: DTensor would replace them.
        dtensor.initialize_accelerator_system(device_type, enable_coordination_service=False)
        # Every client's devices are listed (remote ones too): keep this task's.
        local = [d.name for d in tf.config.list_logical_devices(device_type)
                 if f"/task:{cluster.task_index}/" in d.name]
        mwms = None
    if num_devices:
        local = local[:num_devices]
    return Runtime(cluster, local, mwms)


def _configure_local_devices(tf, cpu_devices: int, num_devices: int) -> str:
    """Logical CPUs (--cpu_devices, or no GPU) or the GPUs; configured, not yet initialised."""
    from tf_multigpu.parallel.devices import DEFAULT_CPU_DEVICES
    gpus = tf.config.list_physical_devices("GPU")
    if gpus and not cpu_devices:
        return "GPU"
    if gpus:
        tf.config.set_visible_devices([], "GPU")
    wanted = cpu_devices or max(num_devices, DEFAULT_CPU_DEVICES)
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * wanted)
    return "CPU"


def describe_peer_failure(error: Exception) -> str:
    """One line for a collective or coordination failure caused by a lost peer."""
    text = str(error)
    reasons = [re.search(p, text) for p in (r"The following tasks are unhealthy[^\n]*\n\s*(\S+)",
                                             r"Collective ops is aborted by: ([^\n\[]+)",
                                             r'grpc_message:"([^"]+)"')]
    found = next((m for m in reasons if m), None)
    if found is None:
        reason = (text.strip().splitlines() or [type(error).__name__])[0]
    elif "unhealthy" in found.group(0):
        reason = f"{found.group(1)} stopped sending heartbeats"
    else:
        reason = found.group(1)
    return (f"lost contact with another worker ({type(error).__name__}: {reason.strip()[:200]}): "
            "restart every worker with the same command to resume from the latest checkpoint")


def _configure_coordination(cluster: Cluster, peer_timeout: int) -> None:
    """TensorFlow's coordination service, leader task 0, with our heartbeat timeout.

    A worker that stops heart-beating for `peer_timeout` seconds is declared dead and every
    other worker's pending and future operations fail; without the service (or with its
    default) a survivor can wait on a dead peer's collective much longer.
    """
    from tf_multigpu.compat import configure_coordination_service
    configure_coordination_service(
        JOB, cluster.num_workers, heartbeat_timeout_s=peer_timeout,
        # Workers start at different times (imports, data loading): wait as long for them.
        register_timeout_s=max(peer_timeout, 60),
        # At exit the chief may still be exporting while the others wait for it.
        shutdown_timeout_s=max(peer_timeout, 600))
