"""`tf.distribute.MultiWorkerMirroredStrategy` over every worker's devices.

Stock MultiWorkerMirroredStrategy uses all GPUs of a worker, but only ONE device of a worker
without GPUs (see `compat.multi_worker_mirrored_strategy`). To test
multi-worker data parallelism with several logical CPU devices per worker, as every other
strategy is tested, the strategy here takes the worker's N logical CPUs as its local devices;
with GPUs it is the stock strategy.
"""

from __future__ import annotations

import tensorflow as tf

from tf_multigpu.compat import multi_worker_mirrored_strategy
from tf_multigpu.parallel.cluster import JOB, Cluster


def make_multi_worker_strategy(cluster: Cluster, device_type: str, cpu_devices: int) -> tf.distribute.Strategy:
    """The strategy for this worker of `cluster`: all local GPUs, or `cpu_devices` logical CPUs."""
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.cluster_spec_dict()), task_type=JOB, task_id=cluster.task_index,
        rpc_layer="grpc")
    options = tf.distribute.experimental.CommunicationOptions()
    from tf_multigpu.parallel.devices import DEFAULT_CPU_DEVICES
    num_cpu = (cpu_devices or DEFAULT_CPU_DEVICES) if device_type == "CPU" else 0
    return multi_worker_mirrored_strategy(resolver, options, num_cpu)
