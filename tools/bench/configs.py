"""What one measured run is, and the sweeps the benchmark offers.

A BenchRun is plain data (it crosses the process boundary as JSON): which implementation
(`kind`: our loop, Keras `model.fit`, or PyTorch DDP), which strategy on how many devices,
which model, data and global batch, and how long to time it. The sweeps only list runs;
running them is runner.py's job.
"""

from __future__ import annotations

import dataclasses
import json

from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.mesh_spec import mesh_flag, mesh_for, replicas_for

STRATEGIES = ("single", "data", "model", "hybrid")
PEERS = ("keras_fit", "torch_ddp")
KINDS = ("ours",) + PEERS

# The paper's five configurations (Yadan et al. 2013, Table 1): (strategy, devices), and the
# speedup over one GPU it reports for each (AlexNet on ImageNet, global batch 256).
PAPER_CONFIGS = (("single", 1), ("data", 2), ("model", 2), ("data", 4), ("hybrid", 4))
PAPER_SPEEDUP = {("single", 1): 1.0, ("data", 2): 1.5, ("model", 2): 1.6, ("data", 4): 1.4, ("hybrid", 4): 2.2}
PAPER_NAMES = {("single", 1): "1 GPU", ("data", 2): "2 GPUs data", ("model", 2): "2 GPUs model",
               ("data", 4): "4 GPUs data", ("hybrid", 4): "4 GPUs hybrid (2 model x 2 data)"}


@dataclasses.dataclass(frozen=True)
class BenchRun:
    """One timed configuration; `batch` is the GLOBAL batch."""

    kind: str              # ours | keras_fit | torch_ddp
    strategy: str          # single | data | model | hybrid (peers: single or data)
    devices: int
    model: str
    batch: int
    dataset: str = "synthetic"
    image_size: int = 0    # 0: the data set's own size (synthetic: 224)
    warmup_steps: int = 3
    timed_steps: int = 10
    cpu_devices: int = 0   # > 0: logical CPU devices; 0: GPUs if any, else logical CPUs
    threads: int = 0       # CPU thread budget shared by the run (0: all cores)
    seed: int = 0
    dtype: str = "float32" # compute dtype (Keras mixed precision for ours and Keras fit)
    xla: bool = False      # XLA-compile the step (ours: forward + backward; Keras fit: jit_compile)

    @property
    def mesh(self) -> str:
        """The DTensor mesh of model/hybrid runs (the defaults of tf-multigpu-train)."""
        if self.strategy not in ("model", "hybrid"):
            return ""
        return mesh_flag(mesh_for(self.strategy, None, self.devices))

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: the global batch splits this many ways."""
        return replicas_for(self.strategy, self.devices)

    def label(self, device_word: str = "GPU") -> str:
        """The configuration as the paper names it, e.g. '4 GPUs hybrid (2 model x 2 data)'."""
        return config_label(self.strategy, self.devices, device_word)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BenchRun:
        return cls(**json.loads(text))


def config_label(strategy: str, devices: int, device_word: str = "GPU") -> str:
    plural = device_word if devices == 1 else device_word + "s"
    if strategy == "single":
        return f"1 {device_word}"
    if strategy == "hybrid":
        return f"{devices} {plural} hybrid (2 model x {devices // 2} data)"
    return f"{devices} {plural} {strategy}"


def grid(strategies, device_counts, batches, models, **common) -> list[BenchRun]:
    """Our runs for strategy x devices x batch x model, keeping the combinations that exist:
    `single` on 1 device only; `data` and `model` on 2 or more; `hybrid` (pairs of model-parallel
    devices, data parallel between the pairs) on 4 or more, an even number; and the global batch
    must divide by the data-parallel replicas."""
    runs = []
    for model in models:
        for batch in batches:
            for strategy in strategies:
                for n in device_counts:
                    run = BenchRun("ours", strategy, n, model, batch, **common)
                    if _exists(run) and batch % run.replicas == 0:
                        runs.append(run)
    return runs


def paper_runs(model="alexnet", batch=256, **common) -> list[BenchRun]:
    """The paper's five configurations (Table 1)."""
    return [BenchRun("ours", s, n, model, batch, **common) for s, n in PAPER_CONFIGS]


def peer_runs(ours: list[BenchRun], peers) -> list[BenchRun]:
    """For each (model, batch, device count) where we ran `single` or `data`, the same work
    under each peer (data parallel over the same devices)."""
    seen, runs = set(), []
    for run in ours:
        if run.strategy not in ("single", "data"):
            continue
        for peer in peers:
            twin = dataclasses.replace(run, kind=peer)
            if twin not in seen:
                seen.add(twin)
                runs.append(twin)
    return runs


def check_lists(strategies, device_counts, batches, models, peers) -> None:
    """Validates the sweep's lists; one-line UsageError naming the fix."""
    for s in strategies:
        if s not in STRATEGIES:
            raise UsageError(f"unknown strategy {s!r} in --strategies: choose from {', '.join(STRATEGIES)}")
    for p in peers:
        if p not in PEERS:
            raise UsageError(f"unknown peer {p!r} in --peers: choose from {', '.join(PEERS)} (or --peers= for none)")
    if not device_counts or min(device_counts) < 1:
        raise UsageError(f"--devices={device_counts} must list device counts >= 1, e.g. --devices=1,2,4")
    if not batches or min(batches) < 1:
        raise UsageError(f"--batch_sizes={batches} must list global batches >= 1, e.g. --batch_sizes=64,128")
    if not models:
        raise UsageError("--models is empty: give e.g. --models=small_convnet,alexnet")


def _exists(run: BenchRun) -> bool:
    if run.strategy == "single":
        return run.devices == 1
    if run.strategy == "hybrid":
        return run.devices >= 4 and run.devices % 2 == 0
    return run.devices >= 2
