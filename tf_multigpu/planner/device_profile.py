"""What the planner assumes of the devices: FLOP rate, memory, and the links between them.

A DeviceProfile comes from a JSON file (`profiles/NAME.json` ships a few well-known machines,
each number with its source) or from a micro-benchmark of a few seconds on the devices a run
will use (`device_bench.measure`, which says what it times). `load` reads and checks a JSON
profile without importing TensorFlow, so the config can refuse a bad --profile first.

Spec-sheet profiles give the peak rate and an assumed `compute_efficiency` (the fraction of
peak a ConvNet step sustains, stated in the file); measured profiles have efficiency 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from tf_multigpu.errors import UsageError
from tf_multigpu.planner import comm

# A momentum update reads the weights, the gradient and the velocity and writes velocity and
# weights: 5 bytes moved per byte of weights (training/optimizer.py's update).
UPDATE_BYTES_PER_PARAM_BYTE = 5
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
    split_conv_replicated: float = 0.0   # share of SplitConv2D's time that a split of its filters does
                                         # not divide (building the patches of its whole input)
    native_split_conv: bool = False      # split convolutions run as native per-device convs (no im2col)
    topology: str = "ring"               # how copies share links: planner/comm.py TOPOLOGIES
    host_bandwidth_bytes_per_s: float = 0.0   # the root complex all host-crossing copies share (0: link's)
    devices_per_switch: int = 0          # topology pcie_switch: devices behind each PCIe switch
    all_reduce: str = "ring"             # the gradient reduction the machine's software runs (comm.ALGORITHMS)
    activation_gather: str = "ring"      # how an all-gather of activations runs (padded_all_reduce: DTensor on CPU)
    input_grad_reduce: str = "all_reduce"   # backward of a gathered input: all_reduce (DTensor) or reduce_scatter
    per_op_overhead_s: float = 0.0       # fixed cost of launching one operation (measured profiles)
    collective_overhead_s: float = 0.0   # fixed cost of one collective in a step, any group size (measured)
    memory_bandwidth_bytes_per_s: float = 0.0   # per device, all busy, for the optimizer update (0: not modelled)
    single_device_memory_bandwidth_bytes_per_s: float = 0.0   # one device alone (0: as above)
    batch_flops_per_s: dict = dataclasses.field(default_factory=dict)   # examples per device -> FLOP/s
                                         # per device, all busy (measured profiles; {}: peak x efficiency)
    batch_split_conv_overhead: dict = dataclasses.field(default_factory=dict)   # examples per device ->
                                         # split_conv_overhead at that batch (measured; {}: the scalar)
    batch_dense_flops_per_s: dict = dataclasses.field(default_factory=dict)   # examples per device ->
                                         # FLOP/s of Dense layers, all busy (measured; {}: flops_at's);
                                         # batch_flops_per_s is then the other layers' rate
    input_images_per_s: float = 0.0      # the run's input pipeline alone (0: not modelled)
    input_shares_cores: bool = False     # the pipeline computes on the devices' cores (logical CPUs):
                                         # its time adds to the step instead of overlapping it
    description: str = ""
    source: dict = dataclasses.field(default_factory=dict)

    @property
    def flops_per_s(self) -> float:
        """The sustained rate of one device while all devices work."""
        return self.peak_flops_per_s * self.compute_efficiency

    def flops_at(self, batch: float) -> float:
        """The sustained rate of one device running `batch` examples while all devices work: a
        CPU's rate grows with the batch (AlexNet 64x64 on 4 logical CPUs: 1.8x from 16 to 64
        examples), so measured profiles keep a rate per batch, interpolated in log(batch) and
        held constant past their ends."""
        return _at_batch(self.batch_flops_per_s, batch) if self.batch_flops_per_s else self.flops_per_s

    def dense_flops_at(self, batch: float) -> float:
        """The rate of one device's Dense layers at `batch` rows while all devices work. A
        fully connected layer reads its whole kernel for `batch` rows, so on CPUs it runs far
        below the convolutions at small batches (AlexNet 64 on 4 logical CPUs, 16 examples per
        device: Dense layers 27, the rest 55 GFLOP/s, BUILD_NOTES): a plan that runs the
        convolutions and the fully connected layers at different batches (conv_data_fc_model)
        needs both rates. Without a measurement, the model's rate."""
        return _at_batch(self.batch_dense_flops_per_s, batch) if self.batch_dense_flops_per_s \
            else self.flops_at(batch)

    def split_conv_overhead_at(self, batch: float) -> float:
        """The split convolution's time over tf.nn.conv2d's at `batch` examples per device (0:
        not known). Its patches grow with the batch while the stock convolution gets more
        efficient, so on CPUs the overhead rises with it (AlexNet 64x64 on 4 logical CPUs:
        0.82x at 16, 0.96x at 32, 1.0x at 64); measured profiles keep one per batch."""
        if self.batch_split_conv_overhead:
            return _at_batch(self.batch_split_conv_overhead, batch)
        return self.split_conv_overhead

    @property
    def alone_flops_per_s(self) -> float:
        """The sustained rate of one device working alone (strategy=single)."""
        return (self.single_device_flops_per_s or self.peak_flops_per_s) * self.compute_efficiency

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _at_batch(by_batch: dict, batch: float) -> float:
    """A per-batch measurement at `batch`: interpolated in log(batch) between the measured
    batches, held constant past their ends."""
    points = sorted((float(b), r) for b, r in by_batch.items())
    if batch <= points[0][0]:
        return points[0][1]
    for (b0, r0), (b1, r1) in zip(points, points[1:]):
        if batch <= b1:
            t = math.log(batch / b0) / math.log(b1 / b0)
            return r0 + t * (r1 - r0)
    return points[-1][1]


def builtin_names() -> list[str]:
    """Names of the shipped profiles."""
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


_POSITIVE = ("peak_flops_per_s", "memory_bytes", "link_bandwidth_bytes_per_s", "compute_efficiency")
_NOT_NEGATIVE = ("link_latency_s", "single_device_flops_per_s", "num_devices", "split_conv_overhead",
                 "split_conv_replicated", "host_bandwidth_bytes_per_s", "devices_per_switch", "per_op_overhead_s",
                 "collective_overhead_s", "memory_bandwidth_bytes_per_s",
                 "single_device_memory_bandwidth_bytes_per_s", "input_images_per_s")


def load(name_or_path: str) -> DeviceProfile:
    """A shipped profile by name (e.g. `titan_pcie3`) or a JSON file with the same fields."""
    path = name_or_path if name_or_path.endswith(".json") else os.path.join(PROFILE_DIR, f"{name_or_path}.json")
    if not os.path.isfile(path):
        what = "a file, but a profile's path ends in .json" if os.path.isfile(name_or_path) else "no such profile"
        raise UsageError(f"--profile={name_or_path}: {what}; give one of {', '.join(builtin_names())}, "
                         "a path to a .json profile, or 'measure'")
    try:
        with open(path) as f:
            values = json.load(f)
        known = {f.name for f in dataclasses.fields(DeviceProfile)}
        profile = DeviceProfile(**{k: v for k, v in values.items() if k in known})
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"--profile={name_or_path} is not a valid profile ({e}): see "
                         f"{os.path.join(PROFILE_DIR, 'titan_pcie3.json')} for the fields") from None
    for field in _POSITIVE:   # the step's time divides by them
        value = getattr(profile, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise UsageError(f"--profile={name_or_path}: {field}={value!r} must be a number > 0: fix the profile")
    for field in _NOT_NEGATIVE:
        value = getattr(profile, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise UsageError(f"--profile={name_or_path}: {field}={value!r} must be a number >= 0: fix the profile")
    for field, allowed in (("topology", comm.TOPOLOGIES), ("all_reduce", comm.ALGORITHMS),
                           ("activation_gather", comm.ALGORITHMS),
                           ("input_grad_reduce", ("all_reduce", "reduce_scatter"))):
        if getattr(profile, field) not in allowed:
            raise UsageError(f"--profile={name_or_path}: {field}={getattr(profile, field)!r} is not one of "
                             f"{', '.join(allowed)}: fix the profile")
    return profile
