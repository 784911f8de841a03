"""Everything about devices, strategies, meshes and layouts; models and data know none of it.

`make_parallelism(strategy, devices, global_batch, all_reduce)` returns the object the
training loop drives: it builds variables in its scope, distributes the input, and runs a
single-replica step function across the devices.
"""

from tf_multigpu.parallel.devices import configure_devices
from tf_multigpu.parallel.tf_distribute import DistributeParallelism


def make_parallelism(strategy: str, devices, global_batch: int, all_reduce: str = "auto"):
    """The parallelism for a --strategy value over `devices`."""
    return DistributeParallelism.create(strategy, devices, global_batch, all_reduce)


__all__ = ["configure_devices", "make_parallelism", "DistributeParallelism"]
