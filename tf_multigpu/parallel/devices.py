"""Finding the devices a run uses, and making logical CPU devices where there are no GPUs.

Logical devices must be configured before TensorFlow initialises its runtime, so the entry
point calls `configure_devices` before anything runs an op (after the flag checks and
TensorFlow's quiet start, which create no device). Logical CPU devices exist so that every strategy
runs and is tested on any machine; they share the same cores, so they show overhead and
correctness, never speedup.
"""

from __future__ import annotations

import tensorflow as tf

from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.mesh_spec import check_device_count

DEFAULT_CPU_DEVICES = 2


def configure_devices(num_devices: int = 0, cpu_devices: int = 0, memory_limit_mb: int = 0,
                      logical_gpus: int = 1) -> list[str]:
    """Names of the devices to use: GPUs if any (first `num_devices`), else logical CPUs.

    `cpu_devices > 0` forces N logical CPU devices even where GPUs exist (GPUs are hidden).
    On GPUs, `memory_limit_mb` caps each device (TensorFlow's logical devices with a memory
    limit) and `logical_gpus` carves that many such devices out of each physical GPU. CPU
    devices cannot be capped; the loop checks its memory estimate against the limit instead.
    """
    gpus = tf.config.list_physical_devices("GPU")
    use_cpu = cpu_devices > 0 or not gpus
    if use_cpu:
        wanted = cpu_devices or max(num_devices, DEFAULT_CPU_DEVICES)
        if gpus:
            _try(lambda: tf.config.set_visible_devices([], "GPU"))
        cpu = tf.config.list_physical_devices("CPU")[0]
        _try(lambda: tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * wanted))
        found = [d.name for d in tf.config.list_logical_devices("CPU")]
        if len(found) < wanted:
            raise UsageError(f"TensorFlow started with {len(found)} CPU devices before {wanted} could be "
                             "made: configure devices before any other TensorFlow call")
        found = found[:wanted]   # the runtime may have been started with more (tests): take the first
    else:
        if memory_limit_mb:
            for gpu in gpus:
                _try(lambda gpu=gpu: tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)] * logical_gpus))
        found = [d.name for d in tf.config.list_logical_devices("GPU")]
    check_device_count(num_devices, len(found), "CPU" if use_cpu else "GPU")
    return found[:num_devices] if num_devices else found


def _try(configure):
    """Applies a device setting; once the runtime has started it can no longer change.

    That happens only when TF was initialised earlier in the same process (tests, notebooks);
    the devices found are then checked against what was asked for by the caller.
    """
    try:
        configure()
    except RuntimeError:
        pass
