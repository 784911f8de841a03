"""The rules a run's flags must meet on its devices and cluster, in one place.

`Config.validate` checks everything that needs no devices. What needs the devices (how many,
of which kind) or the cluster (how many workers) is checked here, with the fix in the message:

- `check_cluster(cfg, cluster)`: the rules the cluster alone decides. The entry point calls it
  as soon as it knows the cluster, before the runtime starts: a worker starting its runtime
  waits for its peers, and a flag error must not wait with it.
- `check_plan(cfg, devices, cluster)`: every rule, on the devices the run uses (every
  worker's, across workers), for a config whose --strategy is resolved (not auto).
  `build_run` calls it before it builds anything, so every run is checked once, whoever
  builds it: the command, the tests, the benchmark worker.
- `check_before_start(cfg, cluster)`: what the flags alone decide, for the entry point to
  call before TensorFlow starts (several seconds on a CPU machine, most of a failed
  command's time): the cluster's rules, where --cpu_devices names the devices the whole
  plan, and last the run directory (a file, or another run's). What needs the runtime (GPUs,
  the model's shapes, the data set's files) is checked after.

Pure Python, like the rest of config/: the mesh rules read `parallel/mesh_spec.py`.
"""

from __future__ import annotations

from tf_multigpu.config.config import Config, check_previous_run
from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.layouts import BATCH_ON_MODEL
from tf_multigpu.parallel.mesh_spec import check_device_count, mesh_for, replicas_for

GPU_ALL_REDUCE = ("nccl", "hierarchical_copy")   # --all_reduce values that need GPUs


def check_cluster(cfg: Config, cluster=None) -> None:
    """Refuses flags that a multi-worker `cluster` (parallel/cluster.py; None: one process)
    cannot run."""
    if cluster is None:
        return
    where = f"{cluster.source} describes {cluster.num_workers} workers"
    if cfg.strategy == "single":
        raise UsageError(f"--strategy=single runs on one device, but {where}: use --strategy=data, model or hybrid")
    if cfg.device_memory_limit or cfg.logical_gpus > 1:
        # The workers' runtime starts on whole devices; refused rather than silently ignored.
        raise UsageError(f"--device_memory_limit and --logical_gpus apply to one process, but {where}: drop them")
    if cfg.strategy == "data" and cfg.all_reduce != "auto":
        raise UsageError(f"--all_reduce={cfg.all_reduce} is for one process: across workers the collective "
                         "implementation is TensorFlow's choice; drop --all_reduce")
    if cfg.strategy == "model" and cfg.layout in BATCH_ON_MODEL:
        raise UsageError(f"{cfg.layout} runs in one process (every device needs the whole batch's "
                         "labels): use --layout=filter_split or fc_only across workers")


def check_before_start(cfg: Config, cluster=None) -> None:
    """The rules the flags decide without TensorFlow: `check_cluster` and, for one process
    on --cpu_devices logical CPUs (their number is the flag's, not the runtime's),
    `check_plan` on those devices. --strategy=auto is checked once the planner has resolved
    it. (The entry point checks the --dataset flags beside it: `data.check_dataset_flags`.)"""
    check_cluster(cfg, cluster)
    if cluster is None and cfg.cpu_devices and cfg.strategy != "auto":
        used = 1 if cfg.strategy == "single" else cfg.num_devices or cfg.cpu_devices
        check_device_count(used, cfg.cpu_devices, "CPU")
        check_plan(cfg, [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(used)])
    check_previous_run(cfg)   # again when the run starts (build_run): library callers skip this function


def check_plan(cfg: Config, devices, cluster=None) -> None:
    """Refuses a config that cannot run on `devices` (names; across workers, every worker's) of
    `cluster`: the cluster's rules, the all-reduce's devices, the mesh, and the global batch
    against the replicas (and, with the batch split over `model`, the model axis)."""
    if cfg.strategy not in ("single", "data", "model", "hybrid"):
        raise ValueError(f"--strategy={cfg.strategy} must be resolved before a run is checked (planner/auto.py)")
    check_cluster(cfg, cluster)
    num_devices = 1 if cfg.strategy == "single" else len(devices)
    if cfg.strategy == "data" and cfg.all_reduce in GPU_ALL_REDUCE and not all("GPU" in d.upper() for d in devices):
        raise UsageError(f"--all_reduce={cfg.all_reduce} needs GPUs but the devices are {', '.join(devices)}: "
                         "use --all_reduce=auto or one_device")
    if cfg.strategy in ("model", "hybrid"):
        shape = mesh_for(cfg.strategy, cfg.mesh_shape, num_devices)
        _check_mesh(cfg.strategy, shape, num_devices, num_devices // cluster.num_workers if cluster else 0,
                    on_cpus=not cfg.num_devices and all("CPU" in d.upper() for d in devices))
        if cfg.layout in BATCH_ON_MODEL and cfg.batch_size % shape["model"]:
            raise UsageError(f"--batch_size={cfg.batch_size} (the global batch) does not divide by the "
                             f"{shape['model']} devices {cfg.layout} splits it over: use a multiple "
                             f"of {shape['model']}")
    replicas = replicas_for(cfg.strategy, num_devices, cfg.mesh_shape)
    if cfg.batch_size % replicas:
        lower = cfg.batch_size - cfg.batch_size % replicas
        raise UsageError(
            f"--batch_size={cfg.batch_size} (the global batch) does not divide by the "
            f"{replicas} replicas: use a multiple of {replicas}, e.g. --batch_size={lower or replicas}")


def _check_mesh(strategy: str, mesh_shape: dict, num_devices: int, devices_per_worker: int = 0,
                on_cpus: bool = False) -> None:
    """The mesh must use exactly the devices, and match the strategy (and, across workers,
    give each worker whole batch groups, or a whole number of workers to each group).
    `on_cpus`: the devices are logical CPUs, which --cpu_devices makes more of."""
    b, m = mesh_shape["batch"], mesh_shape["model"]
    per = devices_per_worker
    if per and b * m == num_devices and per % m and m % per:
        raise UsageError(f"--mesh=batch:{b},model:{m} over workers of {per} devices: the model axis must "
                         "divide or be a multiple of the devices per worker, "
                         f"e.g. --mesh=batch:{num_devices // per},model:{per}")
    if b * m != num_devices:
        more = f"--cpu_devices={b * m}" if on_cpus and not per else f"--num_devices={b * m}"
        raise UsageError(f"--mesh=batch:{b},model:{m} needs {b * m} devices but {num_devices} are used: "
                         f"make B*M = {num_devices}, or use {b * m} devices ({more})")
    if strategy == "model" and b != 1:
        raise UsageError(f"--strategy=model puts every device on the model axis, not --mesh=batch:{b},model:{m}: "
                         "use --strategy=hybrid or --mesh=batch:1,model:N")
    if strategy == "hybrid" and (b < 2 or m < 2):
        raise UsageError(f"--strategy=hybrid needs both mesh axes > 1, not batch:{b},model:{m}: "
                         "e.g. --mesh=batch:2,model:2, or use --strategy=data / --strategy=model")
