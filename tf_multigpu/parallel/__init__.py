"""Everything about devices, strategies, meshes and layouts; models and data know none of it.

`make_parallelism(strategy, devices, global_batch, all_reduce)` returns the object the
training loop drives: it builds variables in its scope, distributes the input, and runs a
single-replica step function across the devices.
"""

from tf_multigpu.config.config import mesh_for
from tf_multigpu.parallel.base import Parallelism
from tf_multigpu.parallel.devices import configure_devices
from tf_multigpu.parallel.tf_distribute import DistributeParallelism


def make_parallelism(strategy: str, devices, global_batch: int, all_reduce: str = "auto",
                     mesh: str = "", layout: str = "filter_split", layout_rules: str = "", runtime=None,
                     batchnorm: str = "sync") -> Parallelism:
    """The parallelism for a --strategy value over `devices`, or, given a started multi-worker
    `runtime` (parallel/cluster.py), over every device of every worker.

    `batchnorm` (sync or per_replica) is for data parallelism: a DTensor mesh computes
    BatchNormalization's statistics over the global batch by itself."""
    if runtime is not None and strategy == "data":
        return DistributeParallelism.multi_worker(runtime, global_batch, all_reduce, batchnorm)
    if strategy in ("single", "data"):
        return DistributeParallelism.create(strategy, devices, global_batch, all_reduce, batchnorm)
    from tf_multigpu.parallel.dtensor_mesh import DTensorParallelism, check_mesh
    from tf_multigpu.parallel.layouts import BATCH_ON_MODEL, check_layout
    local = None
    if runtime is not None:
        devices, local = runtime.all_devices, runtime.local_devices
    shape = mesh_for(strategy, mesh, len(devices))
    check_mesh(strategy, shape, len(devices), len(local) if local else 0)
    return DTensorParallelism(strategy, devices, shape, layout, check_layout(layout, layout_rules), global_batch,
                              local_devices=local, batch_on_model=layout in BATCH_ON_MODEL)


__all__ = ["configure_devices", "make_parallelism", "DistributeParallelism", "Parallelism"]
