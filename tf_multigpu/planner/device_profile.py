"""What the planner assumes of the devices: FLOP rate, memory, and the links between them.

A DeviceProfile comes from a JSON file (`profiles/NAME.json` ships a few well-known machines,
each number with its source) or from `measure(devices)`, a micro-benchmark of a few seconds
on the devices a run will use:

- compute: float32 matmuls on every device at once (the rate each device keeps while all are
  busy, which is what a parallel step sees), and on the first device alone (logical CPU
  devices share the same cores, so one device alone runs up to N times faster; on GPUs the
  two rates are the same). Matmul is the best case of a ConvNet's kernels: the planner's
  times are lower bounds of compute, and that is stated in its table.
- links: a ring all-reduce among all devices (MirroredStrategy, the same collective data
  parallelism uses) of a large tensor (bandwidth) and of one value (latency); the bandwidth is
  the per-device "bus" bandwidth, bytes = 2(N-1)/N x size over time, so that the cost model's
  ring formulas give back the measured time.

Spec-sheet profiles give the peak rate and an assumed `compute_efficiency` (the fraction of
peak a ConvNet step sustains, stated in the file); measured profiles have efficiency 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from tf_multigpu.errors import UsageError
from tf_multigpu.planner import comm

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Per-device compute and memory, and the link between devices."""

    name: str
    peak_flops_per_s: float              # per device, when all devices are busy
    memory_bytes: float                  # per device
    link_bandwidth_bytes_per_s: float    # per device, per direction, in a ring collective
    link_latency_s: float                # per ring hop
    compute_efficiency: float = 1.0      # fraction of the peak a ConvNet step sustains
    single_device_flops_per_s: float = 0.0   # one device alone (0: same as peak_flops_per_s)
    num_devices: int = 0                 # devices in the machine (0: unknown)
    split_conv_overhead: float = 0.0     # SplitConv2D / tf.nn.conv2d time (0: the planner's default)
    native_split_conv: bool = False      # split convolutions run as native per-device convs (no im2col)
    topology: str = "ring"               # how copies share links: planner/comm.py TOPOLOGIES
    host_bandwidth_bytes_per_s: float = 0.0   # the root complex all host-crossing copies share (0: link's)
    devices_per_switch: int = 0          # topology pcie_switch: devices behind each PCIe switch
    all_reduce: str = "ring"             # the gradient reduction the machine's software runs (comm.ALGORITHMS)
    activation_gather: str = "ring"      # how an all-gather of activations runs (padded_all_reduce: DTensor on CPU)
    input_grad_reduce: str = "all_reduce"   # backward of a gathered input: all_reduce (DTensor) or reduce_scatter
    per_op_overhead_s: float = 0.0       # fixed cost of launching one operation (measured profiles)
    description: str = ""
    source: dict = dataclasses.field(default_factory=dict)

    @property
    def flops_per_s(self) -> float:
        """The sustained rate of one device while all devices work."""
        return self.peak_flops_per_s * self.compute_efficiency

    @property
    def alone_flops_per_s(self) -> float:
        """The sustained rate of one device working alone (strategy=single)."""
        return (self.single_device_flops_per_s or self.peak_flops_per_s) * self.compute_efficiency

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def builtin_names() -> list[str]:
    """Names of the shipped profiles."""
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def load(name_or_path: str) -> DeviceProfile:
    """A shipped profile by name (e.g. `titan_pcie3`) or a JSON file with the same fields."""
    path = name_or_path if name_or_path.endswith(".json") else os.path.join(PROFILE_DIR, f"{name_or_path}.json")
    if not os.path.isfile(path):
        raise UsageError(f"--profile={name_or_path}: no such profile; give one of {', '.join(builtin_names())}, "
                         "a path to a .json profile, or 'measure'")
    try:
        with open(path) as f:
            values = json.load(f)
        known = {f.name for f in dataclasses.fields(DeviceProfile)}
        profile = DeviceProfile(**{k: v for k, v in values.items() if k in known})
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"--profile={name_or_path} is not a valid profile ({e}): see "
                         f"{os.path.join(PROFILE_DIR, 'titan_pcie3.json')} for the fields") from None
    for field, allowed in (("topology", comm.TOPOLOGIES), ("all_reduce", comm.ALGORITHMS),
                           ("activation_gather", comm.ALGORITHMS),
                           ("input_grad_reduce", ("all_reduce", "reduce_scatter"))):
        if getattr(profile, field) not in allowed:
            raise UsageError(f"--profile={name_or_path}: {field}={getattr(profile, field)!r} is not one of "
                             f"{', '.join(allowed)}: fix the profile")
    return profile


def measure(devices, matmul_size: int = 512, allreduce_mib: int = 16) -> DeviceProfile:
    """A profile of `devices` (TensorFlow device names) from a few-second micro-benchmark."""
    import tensorflow as tf

    flops_all = _matmul_rate(devices, matmul_size)
    flops_one = _matmul_rate(devices[:1], matmul_size)
    bandwidth, latency = (float("inf"), 0.0) if len(devices) < 2 else _allreduce_rates(devices, allreduce_mib)
    overhead = _split_conv_overhead(devices[0])
    return DeviceProfile(
        name="measured", peak_flops_per_s=flops_all, memory_bytes=_memory_per_device(devices),
        link_bandwidth_bytes_per_s=bandwidth, link_latency_s=latency, compute_efficiency=1.0,
        single_device_flops_per_s=flops_one, num_devices=len(devices), split_conv_overhead=overhead,
        # DTensor lowers an all-gather on CPU to an all-reduce of a zero-padded buffer (BUILD_NOTES).
        activation_gather="ring" if "GPU" in devices[0].upper() else "padded_all_reduce",
        description=f"measured on {len(devices)} x {devices[0]}",
        source={"method": f"float32 {matmul_size}^3 matmuls on all devices at once and on one alone; "
                          f"MirroredStrategy ring all-reduce of {allreduce_mib} MiB and of 1 value; "
                          "split_conv2d against tf.nn.conv2d, forward and backward, 3x3 conv 64->64 on 16x16",
                "tensorflow": tf.__version__, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")})


def _best_time(fn, repeats: int = 3) -> float:
    fn()   # trace and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _matmul_rate(devices, n: int, chain: int = 8) -> float:
    """FLOP/s each device sustains on a chain of n x n matmuls while all of `devices` run one."""
    import tensorflow as tf

    mats = []
    for d in devices:
        with tf.device(d):
            mats.append(tf.random.normal([n, n]) / n ** 0.5)

    @tf.function
    def run():
        outs = []
        for d, x in zip(devices, mats):
            with tf.device(d):
                y = x
                for _ in range(chain):
                    y = tf.matmul(y, x)
                outs.append(tf.reduce_sum(y))
        return outs

    seconds = _best_time(lambda: [o.numpy() for o in run()])
    return chain * 2.0 * n ** 3 / seconds


def _allreduce_rates(devices, mib: int) -> tuple[float, float]:
    """(bus bandwidth in bytes/s per device, latency per ring hop in s) of a ring all-reduce."""
    import tensorflow as tf

    from tf_multigpu.parallel.tf_distribute import _new_collective_key_range

    _new_collective_key_range()   # keys of its own: the training strategy comes after
    strategy = tf.distribute.MirroredStrategy(devices=list(devices))
    n = len(devices)

    def timed(values):
        with strategy.scope():
            var = tf.Variable(tf.ones([values]))

        @tf.function
        def run():
            def replica():
                ctx = tf.distribute.get_replica_context()
                return ctx.all_reduce("sum", var.read_value())[:1]
            return strategy.run(replica)

        return _best_time(lambda: [t.numpy() for t in strategy.experimental_local_results(run())])

    small = timed(1)
    large = timed(mib * 2**20 // 4)
    hops = 2 * (n - 1)
    bandwidth = hops / n * mib * 2**20 / max(large - small, 1e-9)
    return bandwidth, small / hops


def _split_conv_overhead(device: str) -> float:
    """Time of our filter-split convolution (im2col + einsum) over tf.nn.conv2d's, fwd + bwd."""
    import tensorflow as tf

    from tf_multigpu.parallel.split_conv import split_conv2d

    with tf.device(device):
        x = tf.random.normal([16, 16, 16, 64])
        w = tf.Variable(tf.random.normal([3, 3, 64, 64]) * 0.05)

    def step(conv):
        @tf.function
        def run():
            with tf.device(device):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = tf.reduce_sum(conv(x, w))
                return [tf.reduce_sum(g) for g in tape.gradient(y, [x, w])]
        return lambda: [t.numpy() for t in run()]

    ours = _best_time(step(lambda x, w: split_conv2d(x, w, 1, "SAME")), repeats=5)
    stock = _best_time(step(lambda x, w: tf.nn.conv2d(x, w, 1, "SAME")), repeats=5)
    return ours / stock


def _memory_per_device(devices) -> float:
    """GPU memory TensorFlow may use on the device; logical CPUs share the host's RAM."""
    if "GPU" in devices[0].upper():
        from tensorflow.python.client import device_lib  # the only place TF reports it
        limits = [d.memory_limit for d in device_lib.list_local_devices() if d.device_type == "GPU"]
        if limits:
            return float(min(limits))
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / len(devices)
