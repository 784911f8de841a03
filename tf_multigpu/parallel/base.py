"""The interface every parallelism offers the training loop, the reports and the tools.

`DistributeParallelism` (single, data; tf.distribute) and `DTensorParallelism` (model, hybrid;
a DTensor mesh) both satisfy it; code outside `parallel/` relies on these members only, never
on probing for attributes one of them happens to have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import keras
import numpy as np
import tensorflow as tf

from tf_multigpu.parallel.placement import PlacementPlan


@runtime_checkable
class Parallelism(Protocol):
    name: str                   # the --strategy it runs
    devices: list               # every device it computes on
    global_batch: int
    num_replicas: int           # data-parallel groups (the mesh's batch axis)
    input_shard: tuple          # (i, n): this process reads the i-th of n row slices of a batch
    spans_workers: bool
    spmd_lowered: bool          # its collectives appear only in DTensor's SPMD-expanded graph
    plan: PlacementPlan | None  # set by build_model

    @property
    def mesh_shape(self) -> dict: ...       # {"batch": B, "model": M}

    @property
    def replica_batch(self) -> int: ...     # examples per batch group per step

    def scope(self) -> contextlib.AbstractContextManager: ...

    def build_model(self, build: Callable[[], keras.Model]) -> keras.Model: ...

    def distribute(self, make_dataset: Callable[[int], tf.data.Dataset]): ...

    def compile(self, step_fn: Callable[..., dict]) -> Callable: ...

    def to_numpy(self, variable) -> np.ndarray: ...

    def local_shape(self, variable) -> list: ...

    def relayout_like(self, value, variable): ...   # value in variable's layout (optimizer slots)

    def split_dims(self, variable) -> tuple: ...   # dims of variable split over devices

    def any_worker(self, flag: bool) -> bool: ...


def host_scalars(sums: dict) -> dict:
    """A compiled step's dict of scalar tensors as Python floats: the copy to the host, and so
    the point where the host waits for the step (under every parallelism alike)."""
    return {k: float(v.numpy()) for k, v in sums.items()}
