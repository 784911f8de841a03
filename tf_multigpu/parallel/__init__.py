"""Everything about devices, strategies, meshes and layouts; models and data know none of it.

`make_parallelism(strategy, devices, global_batch, ...)` returns the object the training loop
drives: it builds variables in its scope, distributes the input, and runs a single-replica
step function across the devices.

Importing this package does not import TensorFlow: the config parses meshes and layout rules
with its pure-Python modules (`mesh_spec`, `layouts`) before the entry point starts
TensorFlow quietly (cli.start_tensorflow). The TensorFlow-backed names below load on first use.
"""

from __future__ import annotations

from tf_multigpu.parallel.mesh_spec import mesh_for

_LAZY = {   # name -> the module that defines it (imports TensorFlow)
    "Parallelism": "tf_multigpu.parallel.base",
    "configure_devices": "tf_multigpu.parallel.devices",
    "DistributeParallelism": "tf_multigpu.parallel.tf_distribute",
}


def make_parallelism(strategy: str, devices, global_batch: int, all_reduce: str = "auto",
                     mesh_shape: dict | None = None, layout: str = "filter_split", layout_rules=(),
                     runtime=None, batchnorm: str = "sync", shard_optimizer_state: bool = False,
                     layout_overrides=()):
    """The parallelism for a --strategy value over `devices`, or, given a started multi-worker
    `runtime` (parallel/cluster.py), over every device of every worker.

    `mesh_shape` is --mesh parsed (None: the strategy's default mesh, `mesh_spec.mesh_for`) and
    `layout_rules` --layout_rules parsed (`layouts.parse_rules`), `layout_overrides` likewise
    --layout_overrides; the config holds them, and
    `config/plan_checks.py: check_plan` has checked them against the devices. `batchnorm` (sync or
    per_replica) is for data parallelism: a DTensor mesh computes BatchNormalization's
    statistics over the global batch by itself. `shard_optimizer_state`: a hybrid mesh shards
    the momentum over its batch groups (placement.slot_spec)."""
    from tf_multigpu.parallel.tf_distribute import DistributeParallelism
    if runtime is not None and strategy == "data":
        return DistributeParallelism.multi_worker(runtime, global_batch, batchnorm)
    if strategy in ("single", "data"):
        return DistributeParallelism.create(strategy, devices, global_batch, all_reduce, batchnorm)
    from tf_multigpu.parallel.dtensor_mesh import DTensorParallelism
    from tf_multigpu.parallel.layouts import BATCH_ON_MODEL
    local = None
    if runtime is not None:
        devices, local = runtime.all_devices, runtime.local_devices
    return DTensorParallelism(strategy, devices, mesh_for(strategy, mesh_shape, len(devices)), layout,
                              layout_rules, global_batch, local_devices=local, batch_on_model=layout in BATCH_ON_MODEL,
                              shard_slots=shard_optimizer_state, overrides=layout_overrides)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["configure_devices", "make_parallelism", "DistributeParallelism", "Parallelism"]
