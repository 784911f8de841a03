"""`tf.distribute.MultiWorkerMirroredStrategy` over every worker's devices.

Stock MultiWorkerMirroredStrategy uses all GPUs of a worker, but only ONE device of a worker
without GPUs (`CollectiveAllReduceExtended._initialize_local_devices`: "CPU", 1). To test
multi-worker data parallelism with several logical CPU devices per worker, as every other
strategy is tested, the strategy here takes the worker's N logical CPUs as its local devices;
with GPUs it is the stock strategy.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy as _cars

from tf_multigpu.parallel.cluster import JOB, Cluster


class _LogicalCpuExtended(_cars.CollectiveAllReduceExtended):
    """The stock implementation, with N logical CPU devices per worker instead of one."""

    num_cpu_devices = 0   # set on a subclass made per strategy, before __init__ runs

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        if not self.num_cpu_devices:
            return super()._initialize_local_devices(cluster_resolver, worker_device)
        return tuple(f"{worker_device}/device:CPU:{i}" for i in range(self.num_cpu_devices)), "CPU"


class _MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """MultiWorkerMirroredStrategy whose extended object is `_LogicalCpuExtended`."""

    def __init__(self, cluster_resolver, communication_options, num_cpu_devices: int):
        extended_class = type("LogicalCpuExtended", (_LogicalCpuExtended,), {"num_cpu_devices": num_cpu_devices})
        # What MultiWorkerMirroredStrategy.__init__ does, with our extended class (it only
        # adds usage gauges besides).
        tf.distribute.Strategy.__init__(self, extended_class(
            self, cluster_resolver=cluster_resolver, communication_options=communication_options))


def make_multi_worker_strategy(cluster: Cluster, device_type: str, cpu_devices: int,
                               peer_timeout: int) -> tf.distribute.Strategy:
    """The strategy for this worker of `cluster`: all local GPUs, or `cpu_devices` logical CPUs."""
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.cluster_spec_dict()), task_type=JOB, task_id=cluster.task_index,
        rpc_layer="grpc")
    options = tf.distribute.experimental.CommunicationOptions()
    from tf_multigpu.parallel.devices import DEFAULT_CPU_DEVICES
    num_cpu = (cpu_devices or DEFAULT_CPU_DEVICES) if device_type == "CPU" else 0
    return _MultiWorkerMirroredStrategy(resolver, options, num_cpu)
