"""Everything about devices, strategies, meshes and layouts; models and data know none of it.

`make_parallelism(strategy, devices, global_batch, all_reduce)` returns the object the
training loop drives: it builds variables in its scope, distributes the input, and runs a
single-replica step function across the devices.
"""

from tf_multigpu.config.config import mesh_for
from tf_multigpu.parallel.devices import configure_devices
from tf_multigpu.parallel.tf_distribute import DistributeParallelism


def make_parallelism(strategy: str, devices, global_batch: int, all_reduce: str = "auto",
                     mesh: str = "", layout: str = "filter_split", layout_rules: str = ""):
    """The parallelism for a --strategy value over `devices`."""
    if strategy in ("single", "data"):
        return DistributeParallelism.create(strategy, devices, global_batch, all_reduce)
    from tf_multigpu.parallel.dtensor_mesh import DTensorParallelism, check_mesh
    from tf_multigpu.parallel.layouts import BATCH_ON_MODEL, policy_rules
    shape = mesh_for(strategy, mesh, len(devices))
    check_mesh(strategy, shape, len(devices))
    return DTensorParallelism(strategy, devices, shape, policy_rules(layout, layout_rules), global_batch,
                              batch_on_model=layout in BATCH_ON_MODEL)


__all__ = ["configure_devices", "make_parallelism", "DistributeParallelism"]
