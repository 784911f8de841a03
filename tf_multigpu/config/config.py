"""The frozen run configuration, validated once and written to the run directory.

Everything below the entry point reads a Config, never flags. A Config holds its flags' values
(what config.json records) and, parsed once when it is built, the values a run uses:
`mesh_shape` (--mesh), `layout_rule_list` (--layout_rules), `layout_override_list`
(--layout_overrides) and `profile_range`
(--profile_steps); nothing downstream parses those strings again. The rules that need no
devices are `Config.validate`'s; the rules that need the devices or the cluster are
`plan_checks.check_plan`'s, which `build_run` applies once the devices are known.

This module must not import TensorFlow (the entry point builds the config before it starts
TensorFlow quietly): the parsers it uses from `parallel/` are pure Python.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

from tf_multigpu import malloc
from tf_multigpu.config.run_paths import RunPaths
from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.layouts import POLICIES, parse_rules
from tf_multigpu.parallel.mesh_spec import parse_mesh

STRATEGIES = ("single", "data", "model", "hybrid", "auto")   # auto: the planner picks (planner/auto.py)
LAYOUTS = POLICIES   # parallel/layouts.py's built-in policies
ALL_REDUCE = ("auto", "nccl", "hierarchical_copy", "one_device")
LR_SCHEDULES = ("constant", "step", "cosine")
DTYPES = ("float32", "bfloat16", "float16")
AUGMENTS = ("auto", "none", "paper")   # data/augment.py
SAVED_MODEL_FILE = "saved_model.pb"   # what marks a directory as an export (check_export_dir)
# What an export writes (a SavedModel, and export/saved_model.py's extras): anything else in an
# earlier export is a user's, which check_export_dir will not let the replacement delete.
EXPORT_ENTRIES = (SAVED_MODEL_FILE, "fingerprint.pb", "variables", "assets", "assets.extra")
EXPORT_METADATA, EXPORT_KERAS = "metadata.json", "model.keras"   # in assets.extra: export/saved_model.py's names
EXPORT_EXTRAS = (EXPORT_METADATA, EXPORT_KERAS)
MODELS = ("alexnet", "small_convnet")   # models.REGISTRY's names (models/ imports Keras; a test pins both)

BATCHNORMS = ("sync", "per_replica")

# The fields that decide what a run computes. Resuming a run directory with any of these
# changed would silently mix two experiments, so it is refused. Steps, epochs, cadence and
# the device layout may change between runs (a checkpoint restores onto any strategy).
RESULT_FIELDS = (
    "dataset", "image_size", "model", "batch_size", "learning_rate", "lr_schedule",
    "warmup_steps", "momentum", "weight_decay", "seed", "dtype", "augment", "test_fraction",
    "skip_bad_images",
)


@dataclasses.dataclass(frozen=True)
class Config:
    """One training run. `batch_size` is the GLOBAL batch, split evenly over replicas.

    `run_dir=None` is a run in memory (`build_run` for tests and benchmarks): it restores and
    writes nothing. The command line requires --run_dir (`validate`)."""

    run_dir: str | None = None
    strategy: str = "data"
    num_devices: int = 0          # 0: all devices found
    cpu_devices: int = 0          # 0: GPUs if any, else 2 logical CPU devices
    all_reduce: str = "auto"
    profile: str = "measure"      # --strategy=auto: the planner's device profile (a shipped name, a .json, measure)
    mesh: str = ""                # batch:B,model:M; "" = derived from --strategy and the devices
    layout: str = "filter_split"
    layout_rules: str = ""        # REGEX=SPEC;... replaces --layout's built-in rules
    layout_overrides: str = ""    # REGEX=SPEC;... on top of --layout: the variables they match
    dataset: str = "digits"
    data_dir: str | None = None
    image_size: int = 0           # 0: the data set's own size
    augment: str = "auto"         # none | paper (Krizhevsky 2012); auto: paper for ImageNet
    test_fraction: float | None = None   # folder:PATH without val/: held-out share (None: 0.2)
    skip_bad_images: bool = False  # folder:PATH: leave unreadable files out instead of stopping
    input_threads: int = 0        # tf.data threads (0: its default, one per core)
    model: str = "small_convnet"
    batch_size: int = 64
    steps: int | None = None   # None: derived from epochs
    epochs: float = 15.0
    learning_rate: float = 0.05
    lr_schedule: str = "cosine"
    warmup_steps: int = 0
    momentum: float = 0.9
    weight_decay: float = 5e-4
    seed: int = 0
    checkpoint_every: int = 500
    eval_every: int = 0           # 0: once per epoch
    log_every: int = 10
    dtype: str = "float32"        # compute dtype: bfloat16/float16 = Keras mixed precision
    batchnorm: str = "sync"       # data parallelism: BatchNorm statistics over the global batch, or per replica
    shard_optimizer_state: bool = False   # hybrid: each momentum buffer sharded over the batch groups (ZeRO-1)
    xla: bool = False             # XLA-compile each replica's forward and backward pass
    device_memory_limit: int = 0  # MiB per device; 0: no cap
    logical_gpus: int = 1         # logical GPUs carved from each physical GPU
    export: bool = True           # write the SavedModel at the end
    profile_steps: str = ""       # "A,B": trace steps A..B (1-based) for TensorBoard and the comm report
    worker_hosts: str = ""        # every worker's host:port, same list everywhere ("": TF_CONFIG, Slurm, one process)
    task_index: int | None = None   # this worker's position in worker_hosts (0 is the chief)
    peer_timeout: int = 60        # seconds without a heartbeat before a worker is declared lost
    malloc: str = "auto"          # auto | system | tcmalloc | a library's path: preloaded before TensorFlow starts

    # Parsed from the flags above when the config is built (a bad value is a UsageError then).
    mesh_shape: dict | None = dataclasses.field(init=False, repr=False, compare=False)   # --mesh; None: derived
    layout_rule_list: tuple = dataclasses.field(init=False, repr=False, compare=False)   # --layout_rules
    layout_override_list: tuple = dataclasses.field(init=False, repr=False, compare=False)   # --layout_overrides
    profile_range: tuple | None = dataclasses.field(init=False, repr=False, compare=False)  # --profile_steps (A, B)

    def __post_init__(self):
        parsed = {"mesh_shape": parse_mesh(self.mesh) if self.mesh else None,
                  "layout_rule_list": tuple(parse_rules(self.layout_rules)),
                  "layout_override_list": tuple(parse_rules(self.layout_overrides, "--layout_overrides")),
                  "profile_range": parse_profile_steps(self.profile_steps) if self.profile_steps else None}
        for name, value in parsed.items():
            object.__setattr__(self, name, value)   # frozen: set once, here

    def validate(self) -> Config:
        """Checks every value that needs no devices; returns self for chaining."""
        if not self.run_dir:
            raise UsageError("--run_dir is required: give a directory for checkpoints, logs and the export")
        _one_of("strategy", self.strategy, STRATEGIES)
        _one_of("all_reduce", self.all_reduce, ALL_REDUCE)
        _one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _one_of("dtype", self.dtype, DTYPES)
        check_model_name(self.model)
        _at_least("batch_size", self.batch_size, 1)
        _at_least("num_devices", self.num_devices, 0)
        _at_least("cpu_devices", self.cpu_devices, 0)
        _at_least("image_size", self.image_size, 0)
        _one_of("augment", self.augment, AUGMENTS)
        _at_least("input_threads", self.input_threads, 0)
        if self.test_fraction is not None and not 0 < self.test_fraction < 1:
            raise UsageError(f"--test_fraction={self.test_fraction} must be between 0 and 1, e.g. --test_fraction=0.2")
        if self.dataset.startswith("folder:") and len(self.dataset) == 7:
            raise UsageError("--dataset=folder: needs the folder, e.g. --dataset=folder:/data/flowers")
        _at_least("device_memory_limit", self.device_memory_limit, 0)
        _at_least("logical_gpus", self.logical_gpus, 1)
        if self.logical_gpus > 1 and not self.device_memory_limit:
            raise UsageError(f"--logical_gpus={self.logical_gpus} needs --device_memory_limit=MiB: the memory "
                             "each logical GPU gets, e.g. --device_memory_limit=30000")
        _at_least("warmup_steps", self.warmup_steps, 0)
        _at_least("checkpoint_every", self.checkpoint_every, 1)
        _at_least("eval_every", self.eval_every, 0)
        _at_least("log_every", self.log_every, 1)
        _at_least("peer_timeout", self.peer_timeout, 1)
        malloc.check_value(self.malloc)
        if self.task_index is not None and not self.worker_hosts:
            raise UsageError(f"--task_index={self.task_index} needs --worker_hosts=HOST:PORT,HOST:PORT,... "
                             "(the same list on every worker)")
        if self.steps is not None:
            _at_least("steps", self.steps, 0)
        if not self.epochs > 0:
            raise UsageError(f"--epochs={self.epochs} must be > 0 (or give --steps)")
        if not self.learning_rate > 0:
            raise UsageError(f"--learning_rate={self.learning_rate} must be > 0, e.g. --learning_rate=0.01")
        if not 0 <= self.momentum < 1:
            raise UsageError(f"--momentum={self.momentum} must be in [0, 1), e.g. --momentum=0.9")
        if self.weight_decay < 0:
            raise UsageError(f"--weight_decay={self.weight_decay} must be >= 0, e.g. --weight_decay=5e-4")
        if self.strategy == "single" and self.num_devices > 1:
            raise UsageError(f"--strategy=single uses one device but --num_devices={self.num_devices}: "
                             "drop --num_devices or use --strategy=data")
        if self.mesh and self.strategy not in ("model", "hybrid"):
            raise UsageError(f"--mesh applies to --strategy=model or hybrid, not {self.strategy}: drop --mesh")
        if self.layout_rules and self.strategy not in ("model", "hybrid"):
            raise UsageError(f"--layout_rules applies to --strategy=model or hybrid, not {self.strategy}")
        if self.layout_overrides and self.strategy not in ("model", "hybrid", "auto"):
            raise UsageError(f"--layout_overrides applies to --strategy=model, hybrid or auto (its model and hybrid "
                             f"plans), not {self.strategy}")
        if self.layout_overrides and self.layout_rules:
            raise UsageError("--layout_rules replaces --layout's rules and --layout_overrides amends them: give one "
                             "(your overrides as the first --layout_rules, or drop --layout_rules)")
        if self.layout not in LAYOUTS:
            raise UsageError(f"unknown --layout={self.layout!r}: choose one of {', '.join(LAYOUTS)}, "
                             "or give --layout_rules='REGEX=SPEC;...'")
        if self.layout == "conv_data_fc_model" and self.strategy == "hybrid":
            raise UsageError("--layout=conv_data_fc_model splits the batch over every device, and on a hybrid mesh "
                             "that is one tensor dimension over two mesh axes, which DTensor cannot shard: "
                             "use --strategy=model (mesh batch:1,model:N)")
        # Flags that another strategy would silently ignore are refused instead.
        if self.layout != Config.layout and self.strategy not in ("model", "hybrid"):
            raise UsageError(f"--layout applies to --strategy=model or hybrid, not {self.strategy}: drop --layout")
        if self.all_reduce != Config.all_reduce and self.strategy != "data":
            raise UsageError(f"--all_reduce applies to --strategy=data, not {self.strategy}: drop --all_reduce")
        _one_of("batchnorm", self.batchnorm, BATCHNORMS)
        if self.batchnorm != Config.batchnorm and self.strategy != "data":
            raise UsageError(f"--batchnorm={self.batchnorm} applies to --strategy=data, not {self.strategy} "
                             "(one device "
                             "and a DTensor mesh use the global batch's statistics): drop --batchnorm")
        if self.shard_optimizer_state and self.strategy != "hybrid":
            raise UsageError(f"--shard_optimizer_state shards the optimizer state over a hybrid mesh's batch groups; "
                             f"--strategy={self.strategy} has one copy of it per device already: "
                             "use --strategy=hybrid or drop the flag")
        if self.shard_optimizer_state and not self.momentum:
            raise UsageError("--shard_optimizer_state shards the momentum buffers, and --momentum=0 has none: "
                             "drop the flag or set --momentum")
        if self.profile != Config.profile:
            if self.strategy != "auto":
                raise UsageError(f"--profile applies to --strategy=auto, not {self.strategy}: drop --profile")
            from tf_multigpu.planner.device_profile import load
            load(self.profile)   # a bad name fails here, with the shipped names in the message
        check_data_dir(self.dataset, self.data_dir)
        if self.data_dir is not None and not os.access(self.data_dir, os.R_OK | os.X_OK):
            raise UsageError(f"--data_dir={self.data_dir} is not a readable directory: "
                             "point it at the TFDS data directory (e.g. ~/tensorflow_datasets)")
        return self

    def to_dict(self) -> dict:
        """The flags' values (what config.json holds; the parsed values follow from them)."""
        return {name: getattr(self, name) for name in flag_names()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def write(self, path: str) -> None:
        write_atomically(path, self.to_json() + "\n")


def parse_profile_steps(text: str) -> tuple[int, int]:
    """`A,B` -> (A, B): the first and last step to profile, 1 <= A <= B (`A` alone: one step)."""
    parts = text.split(",")
    try:
        first, last = int(parts[0]), int(parts[-1])
    except ValueError:
        first = last = 0
    if len(parts) > 2 or not 1 <= first <= last:
        raise UsageError(f"--profile_steps={text!r} is not A,B with 1 <= A <= B: e.g. --profile_steps=10,12 "
                         "traces steps 10 to 12 (skip the first steps: they include compilation)")
    return first, last


def flag_names() -> list[str]:
    """The Config fields that are flags (the parsed values are not)."""
    return [f.name for f in dataclasses.fields(Config) if f.init]


def load_config(path: str) -> Config:
    """Reads a config written by `Config.write`."""
    with open(path) as f:
        values = json.load(f)
    known = set(flag_names())
    return Config(**{k: v for k, v in values.items() if k in known})


def load_run_config(run_dir: str) -> Config:
    """The config.json of the run in `run_dir`; UsageError naming the fix when the directory is
    not a training run's."""
    if not os.path.isdir(run_dir):
        raise UsageError(f"--run_dir={run_dir} is not a directory: give the --run_dir of a training run")
    path = RunPaths(run_dir).config
    if not os.path.exists(path):
        raise UsageError(f"--run_dir={run_dir} has no config.json: give the --run_dir of a training run")
    try:
        return load_config(path)
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"{path} is unreadable ({str(e).splitlines()[0][:200]}): "
                         "give the --run_dir of a training run") from None


def no_checkpoint(run_dir: str) -> UsageError:
    """The error for a run directory that holds no checkpoint to export."""
    return UsageError(f"--run_dir={run_dir} has no checkpoint in checkpoints/: train it first "
                      f"(tf-multigpu-train --run_dir={run_dir}) or pass --checkpoint=PATH")


def check_exportable_run(run_dir: str, checkpoint: str | None = None, export_dir: str | None = None) -> Config:
    """What the run directory's files alone decide about exporting it, checked before
    TensorFlow starts (a tenth of a second, not six): a training run's config.json, a
    --checkpoint's index file or else at least one checkpoint's, and an --export_dir that is
    ours to replace (`check_export_dir`). Returns the run's Config.
    (Whether the latest checkpoint is readable needs TensorFlow: export/from_checkpoint.py.)"""
    cfg = load_run_config(run_dir)
    if checkpoint is None and not glob.glob(os.path.join(RunPaths(run_dir).checkpoints, "*.index")):
        raise no_checkpoint(run_dir)
    if (checkpoint is not None and "://" not in checkpoint   # a local path (gs:// is TensorFlow's to read)
            and not os.path.isdir(checkpoint) and not os.path.exists(checkpoint + ".index")):
        raise UsageError(f"--checkpoint={checkpoint} is not a checkpoint (no {checkpoint}.index): "
                         "give a prefix such as RUN_DIR/checkpoints/ckpt-100, without .index")
    check_export_dir(os.path.abspath(export_dir or RunPaths(run_dir).export))
    return cfg


def write_atomically(path: str, text: str) -> None:
    """Writes `text` to `path` through a staging file: a failure leaves the previous file, never
    half of one (config.json, summary.json)."""
    staging = f"{path}.tmp-{os.getpid()}"
    try:
        with open(staging, "w") as f:
            f.write(text)
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def checkpoints_on_disk(directory: str) -> list[str]:
    """The prefixes of the checkpoints in `directory` whose index file exists, oldest first
    (by the step in their name: ckpt-10 after ckpt-9). What a run resumes from, and exports,
    when the CheckpointManager's state file (`checkpoints/checkpoint`) is lost or names files
    moved away."""
    found = []
    for index in glob.glob(os.path.join(glob.escape(directory), "ckpt-*.index")):
        prefix = index[: -len(".index")]
        number = os.path.basename(prefix)[len("ckpt-"):]
        if number.isdigit():
            found.append((int(number), prefix))
    return [prefix for _, prefix in sorted(found)]


def check_export_dir(export_dir: str) -> None:
    """Refuses a target that cannot be written (under a file) or is not ours to replace (a
    file, or a directory with other contents).

    The export replaces the whole directory, so a mistyped --export_dir=$HOME must not be
    taken for an old export.
    """
    if os.path.isfile(export_dir):
        raise UsageError(f"--export_dir={export_dir} is a file: give a new directory or an earlier export")
    ancestor = os.path.dirname(export_dir)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise UsageError(f"cannot write the export to {export_dir}: {ancestor} is a file, not a directory; "
                         "choose another --export_dir")
    if not os.path.isdir(export_dir) or not os.listdir(export_dir):
        return
    if not os.path.exists(os.path.join(export_dir, SAVED_MODEL_FILE)):
        raise UsageError(f"--export_dir={export_dir} holds files that are not a SavedModel: "
                         "give a new directory or an earlier export (it is replaced as a whole)")
    # An earlier export, but with a user's files added (notes, a README): replacing it would
    # delete them, so only the entries an export writes are allowed.
    foreign = sorted(set(os.listdir(export_dir)) - set(EXPORT_ENTRIES))
    extra = os.path.join(export_dir, "assets.extra")
    if os.path.isdir(extra):
        foreign += sorted(os.path.join("assets.extra", f) for f in set(os.listdir(extra)) - set(EXPORT_EXTRAS))
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise UsageError(f"--export_dir={export_dir} is an earlier export holding files it did not write "
                         f"({', '.join(foreign[:3])}{more}), which replacing it would delete: move them out, "
                         "or give a new directory")


def check_previous_run(cfg: Config) -> RunPaths:
    """Refuses a run directory that is unusable or holds a different run; writes nothing.
    Pure Python: the entry point applies it before TensorFlow starts, the run again."""
    paths = RunPaths(os.path.abspath(cfg.run_dir))
    if os.path.exists(paths.root) and not os.path.isdir(paths.root):
        raise UsageError(f"--run_dir={cfg.run_dir} is a file, not a directory: give a directory path")
    if os.path.exists(paths.config):
        try:
            previous = load_config(paths.config)
        except (OSError, ValueError, TypeError) as e:
            raise UsageError(f"{paths.config} is unreadable ({e}): use a new --run_dir") from None
        check_resumable(previous, cfg)
    if cfg.export:   # before training, not after it: the export is the run's last write
        check_export_dir(paths.export)
    return paths


def check_resumable(previous: Config, current: Config) -> None:
    """Refuses to continue a run directory whose run computed something else."""
    changed = [f"--{name}: {getattr(previous, name)!r} -> {getattr(current, name)!r}"
               for name in RESULT_FIELDS if getattr(previous, name) != getattr(current, name)]
    if changed:
        raise UsageError(
            f"--run_dir={current.run_dir} holds a run with other settings ({'; '.join(changed)}): "
            "use a new --run_dir, or the same flags to resume it")


def check_data_dir(dataset: str, data_dir: str | None) -> None:
    """Refuses a --data_dir that the data set would ignore (only TFDS reads one)."""
    if data_dir is not None and not dataset.startswith("tfds:"):
        raise UsageError(f"--data_dir applies to --dataset=tfds:NAME, not {dataset}: drop --data_dir")


def check_model_name(name: str) -> None:
    """Refuses a --model that is neither a registry name nor package.module:function (the same
    message as models.get_factory's, without importing Keras)."""
    if ":" not in name and name not in MODELS:
        raise UsageError(f"unknown --model={name!r}: choose one of {', '.join(MODELS)}, or package.module:function")


def _one_of(name, value, allowed):
    if value not in allowed:
        raise UsageError(f"unknown --{name}={value!r}: choose one of {', '.join(allowed)}")


def _at_least(name, value, low):
    if value < low:
        raise UsageError(f"--{name}={value} must be >= {low}")
