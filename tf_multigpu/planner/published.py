"""Published speedups and throughputs the planner must reproduce, and the fits behind them.

Two machines, each a shipped profile whose free constants are fitted here to as few
published figures as the profile has free constants; every other figure of the same table is
held out and only predicted (`reproduce`), so the comparison tests the cost model, not the
fit. Each table uses its source's model: the package's AlexNet (one tower, 224 x 224 x 3, 1000
classes) for the paper; tf_cnn_benchmarks' own AlexNet (64-192-384-384-256 filters, 227 x 227,
1001 classes; `models.alexnet.tf_cnn_benchmarks_alexnet`) for the DGX-1.

- `yadan2013`: Yadan, Adams, Taigman, Ranzato 2013 (arXiv:1312.5853), 4 TITAN on PCIe,
  global batch 256 (the paper's regime: the batch is split, so per-device work shrinks).
  Fitted: compute efficiency on the single-GPU step time (10.5 days for 100 epochs of
  1,281,167 images at batch 256) and the root complex's bandwidth on the 2-GPU data-parallel
  speedup (1.5x). Held out: 2-GPU model parallel 1.6x, 4-GPU data parallel 1.4x, 4-GPU hybrid
  (2 model-parallel pairs) 2.2x.
- `p100_dgx1`: TensorFlow's performance guide (tf_cnn_benchmarks, 2017), AlexNet on a DGX-1,
  512 images per GPU, synthetic data, replicated variables with NCCL (weak scaling: the
  per-device batch is fixed). Fitted: compute efficiency on the 1-GPU throughput. Held out:
  2, 4 and 8 GPUs. The same machine at the paper's fixed global batch is predicted too.
"""

from __future__ import annotations

import dataclasses
import math

from tf_multigpu.planner.device_profile import DeviceProfile, load
from tf_multigpu.planner.predict import predict_plan

IMAGENET_TRAIN_IMAGES = 1_281_167
# Yadan et al.: "10.5 days" for 100 epochs on one GPU at batch 256.
YADAN_SINGLE_STEP_S = 10.5 * 86400 / (100 * IMAGENET_TRAIN_IMAGES / 256)


@dataclasses.dataclass(frozen=True)
class Figure:
    """One published number: a plan (strategy, mesh B x M, layout) at a global batch."""

    label: str
    strategy: str
    batch_groups: int      # size of the mesh's batch axis
    model_devices: int     # size of the mesh's model axis
    layout: str
    global_batch: int
    published: float
    unit: str        # "s/step", "x" (speedup over one device) or "images/s"
    role: str        # "fit" or "held out"


YADAN2013 = (
    Figure("1 GPU", "single", 1, 1, "", 256, YADAN_SINGLE_STEP_S, "s/step", "fit"),
    Figure("2 GPUs data parallel", "data", 2, 1, "", 256, 1.5, "x", "fit"),
    Figure("2 GPUs model parallel", "model", 1, 2, "filter_split", 256, 1.6, "x", "held out"),
    Figure("4 GPUs data parallel", "data", 4, 1, "", 256, 1.4, "x", "held out"),
    Figure("4 GPUs hybrid (2 model-parallel pairs)", "hybrid", 2, 2, "filter_split", 256, 2.2, "x", "held out"),
)
# tf_cnn_benchmarks, AlexNet, DGX-1 (8 x P100), 512 images per GPU, synthetic, replicated + NCCL.
DGX1_IMAGES_PER_DEVICE = 512
P100_DGX1 = tuple(
    Figure(f"{n} GPU{'s' if n > 1 else ''} data parallel", "single" if n == 1 else "data", n, 1, "",
           DGX1_IMAGES_PER_DEVICE * n, images, "images/s", "fit" if n == 1 else "held out")
    for n, images in ((1, 2987), (2, 5658), (4, 10509), (8, 17822)))
TABLES = {"yadan2013": YADAN2013, "p100_dgx1": P100_DGX1}


_COSTS = {}


def table_cost(name: str):
    """The per-layer cost of table `name`'s model (built once per process)."""
    if name not in _COSTS:
        from tf_multigpu.models import build_model
        from tf_multigpu.models.alexnet import tf_cnn_benchmarks_alexnet
        from tf_multigpu.planner.cost_model import analyze
        model = tf_cnn_benchmarks_alexnet() if name == "p100_dgx1" else build_model("alexnet", (224, 224, 3), 1000)
        _COSTS[name] = analyze(model)
    return _COSTS[name]


@dataclasses.dataclass(frozen=True)
class Row:
    """A published figure beside the prediction; error = predicted / published - 1."""

    figure: Figure
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.figure.published - 1


def predicted(cost, profile: DeviceProfile, figure: Figure) -> float:
    """The planner's value of `figure` in the figure's unit."""
    plan = predict_plan(cost, profile, figure.global_batch, figure.strategy, figure.batch_groups,
                        figure.model_devices, figure.layout)
    if plan.error:
        raise ValueError(f"{figure.label}: {plan.error}")
    if figure.unit == "s/step":
        return plan.step_time_s
    if figure.unit == "images/s":
        return figure.global_batch / plan.step_time_s
    single = predict_plan(cost, profile, figure.global_batch, "single", 1, 1, "")
    return single.step_time_s / plan.step_time_s


def reproduce(name: str, profile: DeviceProfile | None = None) -> list[Row]:
    """Every published figure of table `name` beside the planner's prediction."""
    profile, cost = profile or load(name), table_cost(name)
    return [Row(f, predicted(cost, profile, f)) for f in TABLES[name]]


def fit_efficiency(cost, profile: DeviceProfile, figure: Figure) -> float:
    """The compute efficiency at which one device's predicted step time is the figure's."""
    target = figure.published if figure.unit == "s/step" else figure.global_batch / figure.published
    plan = predict_plan(cost, dataclasses.replace(profile, compute_efficiency=1.0), figure.global_batch,
                        "single", 1, 1, "")
    flops_time = plan.compute_s   # at efficiency 1 (shipped profiles have no per-op overhead)
    return flops_time / target


def fit_host_bandwidth(cost, profile: DeviceProfile, figure: Figure) -> float:
    """The root complex bandwidth at which the figure's speedup is predicted (bisection:
    the speedup grows with the bandwidth)."""
    lo, hi = 1e7, 1e12
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if predicted(cost, dataclasses.replace(profile, host_bandwidth_bytes_per_s=mid), figure) > figure.published:
            hi = mid
        else:
            lo = mid
    return math.sqrt(lo * hi)


def fit(name: str, profile: DeviceProfile | None = None) -> dict:
    """The free constants of profile `name` fitted to its table's "fit" figures only."""
    profile, cost = profile or load(name), table_cost(name)
    figures = [f for f in TABLES[name] if f.role == "fit"]
    efficiency = fit_efficiency(cost, profile, figures[0])
    out = {"compute_efficiency": efficiency}
    if name == "yadan2013":
        profile = dataclasses.replace(profile, compute_efficiency=efficiency)
        out["host_bandwidth_bytes_per_s"] = fit_host_bandwidth(cost, profile, figures[1])
    return out


def _value(figure: Figure, value: float) -> str:
    if figure.unit == "x":
        return f"{value:.2f}x"
    if figure.unit == "s/step":
        return f"{value:.3f} s/step"
    return f"{value:,.0f} images/s"


def to_markdown(name: str, profile: DeviceProfile | None = None) -> str:
    """The published table beside the predictions, with the fitted/held-out role of each."""
    profile, cost = profile or load(name), table_cost(name)
    rows = reproduce(name, profile)
    regime = ("fixed global batch 256, the paper's regime" if name == "yadan2013"
              else f"fixed per-device batch {DGX1_IMAGES_PER_DEVICE} (weak scaling)")
    lines = [f"## Published figures against the planner: profile {name} ({cost.name}, {regime})", "",
             "| configuration | published | predicted | error | used for |", "| --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r.figure.label} | {_value(r.figure, r.figure.published)} | "
                     f"{_value(r.figure, r.predicted)} | {100 * r.error:+.1f}% | {r.figure.role} |")
    order = sorted((r for r in rows if r.figure.unit == "x"), key=lambda r: -r.predicted)
    if order:
        published = sorted(order, key=lambda r: -r.figure.published)
        same = [r.figure.label for r in order] == [r.figure.label for r in published]
        lines += ["", "Predicted order: " + " > ".join(r.figure.label for r in order)
                  + (" (the paper's)." if same else "; the paper's: "
                     + " > ".join(r.figure.label for r in published) + ".")]
    if name == "p100_dgx1":
        lines += ["", "The same machine at the paper's fixed global batch (256, split over the GPUs): "
                  + ", ".join(f"{n} GPUs {predicted(cost, profile, Figure('', 'data', n, 1, '', 256, 1, 'x', '')):.2f}x"
                              for n in (2, 4, 8)) + " over one GPU at batch 256."]
    return "\n".join(lines) + "\n"
