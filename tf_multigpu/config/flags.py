"""Every command-line flag of tf-multigpu-train, defined in one place.

Flags are named for what a user means; `--batch_size` is the GLOBAL batch. The defaults
train the small ConvNet on the embedded digits with data parallelism. `config_from_flags`
turns the parsed flags into the frozen Config; nothing else reads FLAGS.
"""

from absl import flags

from tf_multigpu import malloc
from tf_multigpu.config.config import (
    ALL_REDUCE,
    BATCHNORMS,
    DTYPES,
    LAYOUTS,
    LR_SCHEDULES,
    STRATEGIES,
    Config,
    flag_names,
)
from tf_multigpu.config.workload_flags import define_workload_flags

_D = Config  # defaults live on the dataclass; flags only restate them

flags.DEFINE_string("run_dir", None, "Directory for everything a run writes: config, checkpoints, "
                    "TensorBoard logs, summary.json and export/. Rerunning the same command resumes.")
flags.DEFINE_string("strategy", _D.strategy, f"How to use the devices: one of {', '.join(STRATEGIES)}. "
                    "single: one device; data: MirroredStrategy data parallelism over all devices; "
                    "model: conv filters and dense units split over all devices (DTensor); hybrid: "
                    "model-parallel groups, data parallel between them (--mesh); auto: the planner "
                    "measures the devices and picks the fastest strategy, mesh and layout that fit.")
flags.DEFINE_string("mesh", _D.mesh, "Device mesh for model/hybrid: batch:B,model:M with B*M = devices. "
                    "Default: batch:1,model:N for model; batch:N/2,model:2 for hybrid.")
flags.DEFINE_string("layout", _D.layout, f"Model-parallel layout policy: one of {', '.join(LAYOUTS)}. "
                    "filter_split: conv filters and dense units (the classifier's too, where they "
                    "divide) split (the paper); fc_only: dense layers split, convs replicated on "
                    "the model axis; conv_data_fc_model "
                    "(--strategy=model only): convs data parallel over all devices, the batch "
                    "all-gathered before the first dense layer, dense layers split over all devices "
                    "(Krizhevsky 2014's \"one weird trick\").")
flags.DEFINE_string("layout_rules", _D.layout_rules, "Your own layout: 'REGEX=SPEC;...' over Keras "
                    "variable paths, SPEC one of -,batch,model per dimension, e.g. "
                    "'.*conv2/kernel=-,-,-,model;.*fc6/kernel=-,model'. Replaces --layout's rules "
                    "(--layout=conv_data_fc_model still splits the input batch over the model axis).")
flags.DEFINE_string("layout_overrides", _D.layout_overrides, "Amend --layout: 'REGEX=SPEC;...' over "
                    "Keras variable paths, for the variables they match; --layout places the rest. "
                    "E.g. '.*conv1/kernel=-,-,-,-;.*conv1/bias=-' keeps conv1 whole.")
flags.DEFINE_integer("num_devices", _D.num_devices, "Use only the first N devices (0: all found).")
flags.DEFINE_integer("cpu_devices", _D.cpu_devices,
                     "Split the CPU into N logical devices and use them instead of GPUs. For testing "
                     "every strategy on any machine, not for speed. 0: GPUs if any, else 2 logical CPUs.")
flags.DEFINE_string("all_reduce", _D.all_reduce, f"Cross-device gradient reduction for --strategy=data: "
                    f"one of {', '.join(ALL_REDUCE)} (auto: TensorFlow's choice; nccl needs GPUs).")
# --model, --dataset, --data_dir, --image_size, --batch_size: shared with tf-multigpu-plan and the tools.
define_workload_flags(model=_D.model, dataset=_D.dataset, data_dir=_D.data_dir, image_size=_D.image_size,
                      batch_size=_D.batch_size)
flags.DEFINE_string("augment", _D.augment, "Training-image augmentation: none (images resized to "
                    "--image_size), paper (Krizhevsky 2012: shorter side to 256, random 224 crop and "
                    "mirror; centre crop for testing), or auto (paper for tfds:imagenet2012 and folders "
                    "of ImageNet's nXXXXXXXX classes, else none).")
flags.DEFINE_float("test_fraction", _D.test_fraction, "--dataset=folder:PATH without a val/ or test/ "
                   "folder: the share of each class held out for testing (fixed split; default 0.2).")
flags.DEFINE_integer("input_threads", _D.input_threads, "Threads of the input pipeline (0: tf.data's "
                     "default, one per CPU core). More than the cores helps when images come from "
                     "network storage; see README, 'Input throughput'.")
flags.DEFINE_boolean("skip_bad_images", _D.skip_bad_images, "--dataset=folder:PATH: leave unreadable "
                     "images out (counted in summary.json) instead of stopping with the file's name.")
flags.DEFINE_string("profile", _D.profile, "--strategy=auto plans with this device profile: a shipped name "
                    "(tf-multigpu-plan --help lists them), a profile .json, or measure (benchmark this "
                    "run's devices for a few seconds).")
flags.DEFINE_integer("steps", _D.steps, "Training steps in all (overrides --epochs). 0: build, export "
                     "the initial model and exit.")
flags.DEFINE_float("epochs", _D.epochs, "Training epochs, when --steps is not given.")
flags.DEFINE_float("learning_rate", _D.learning_rate, "Peak learning rate of SGD.")
flags.DEFINE_string("lr_schedule", _D.lr_schedule, f"One of {', '.join(LR_SCHEDULES)}. step: divide by "
                    "10 at 50% and 75% of the steps (the paper's manual schedule, automated).")
flags.DEFINE_integer("warmup_steps", _D.warmup_steps, "Linear learning-rate warm-up steps.")
flags.DEFINE_float("momentum", _D.momentum, "SGD momentum.")
flags.DEFINE_float("weight_decay", _D.weight_decay, "L2 weight decay on kernels, added to the gradient "
                   "before momentum as in Krizhevsky et al. 2012.")
flags.DEFINE_integer("seed", _D.seed, "Seed for initial weights and batch order; the same seed gives the "
                     "same weights and batches under every strategy and device count.")
flags.DEFINE_integer("checkpoint_every", _D.checkpoint_every, "Save a checkpoint every N steps (and at the end).")
flags.DEFINE_integer("eval_every", _D.eval_every, "Evaluate on the test split every N steps (0: each epoch).")
flags.DEFINE_integer("log_every", _D.log_every, "Update the progress bar and TensorBoard every N steps.")
flags.DEFINE_string("dtype", _D.dtype, f"Compute dtype, one of {', '.join(DTYPES)}. bfloat16 and float16 "
                    "are Keras mixed precision (weights and updates stay float32); float16 adds dynamic "
                    "loss scaling.")
flags.DEFINE_string("batchnorm", _D.batchnorm, f"BatchNormalization under --strategy=data: one of "
                    f"{', '.join(BATCHNORMS)}. sync: batch statistics over the global batch (all-reduced "
                    "across replicas), so the step is one device's; per_replica: each replica normalises "
                    "by its own share's statistics (no extra all-reduce, a different model).")
flags.DEFINE_boolean("shard_optimizer_state", _D.shard_optimizer_state, "--strategy=hybrid: shard each "
                     "momentum buffer over the mesh's batch groups too (ZeRO stage 1), instead of one copy "
                     "per group: less memory per device, for an all-gather of the new velocities over "
                     "`batch` each step (DTensor's reduce-scatter is an all-reduce and a slice except with "
                     "NCCL, so on CPUs that adds half the gradient all-reduce's bytes).")
flags.DEFINE_boolean("xla", _D.xla, "XLA-compile (jit_compile) each replica's forward and backward pass.")
flags.DEFINE_integer("device_memory_limit", _D.device_memory_limit, "MiB of memory per device (0: no cap). "
                     "GPUs get logical devices capped at this size; on CPUs the run's estimated bytes per "
                     "device are checked against it. A run that does not fit exits with status 3.")
flags.DEFINE_integer("logical_gpus", _D.logical_gpus, "Carve K logical GPUs out of each physical GPU (needs "
                     "--device_memory_limit): tries multi-device strategies on one GPU; they do not use NCCL.")
flags.DEFINE_boolean("export", _D.export, "Export a SavedModel at the end (--noexport: skip, e.g. for benchmarks).")
flags.DEFINE_string("profile_steps", _D.profile_steps, "A,B: trace training steps A to B (counted from 1) "
                    "with the TensorFlow profiler into RUN_DIR/tensorboard (profile tab) and write the "
                    "communication report RUN_DIR/comm_report.{md,json}. Skip the first steps (compilation).")
flags.DEFINE_string("worker_hosts", _D.worker_hosts, "Multi-worker training: HOST:PORT of every worker, "
                    "comma-separated, the same list on every worker (default: TF_CONFIG, else Slurm, else "
                    "one process). With a cluster, --cpu_devices and --num_devices count per worker.")
flags.DEFINE_integer("task_index", _D.task_index, "This worker's position in --worker_hosts; 0 is the chief, "
                     "which alone writes config, summaries, summary.json and the export.")
flags.DEFINE_integer("peer_timeout", _D.peer_timeout, "Multi-worker: seconds a worker may go silent (no "
                     "heartbeat) before the others stop with an error instead of waiting for it.")
malloc.define_flag(_D.malloc)   # in malloc.py: tools that start training runs take it too

FLAGS = flags.FLAGS


def config_from_flags(flag_values=FLAGS) -> Config:
    """The validated Config for the parsed flags."""
    return Config(**{name: flag_values[name].value for name in flag_names()}).validate()
