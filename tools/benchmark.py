"""Benchmark sweep: strategy x devices x global batch x model, with peers, tables and plots.

    python -m tools.benchmark --smoke --out_dir=runs/bench_smoke          # CI-sized, about 1 min
    python -m tools.benchmark --paper --cpu_devices=4 --out_dir=runs/paper  # the paper's 5 configs
    python -m tools.benchmark --paper --image_size=112 --cpu_devices=4 --out_dir=runs/paper112
    python -m tools.benchmark --models=small_convnet --image_size=64 --devices=1,2,4 \\
        --batch_sizes=64,128,256 --strategies=single,data --out_dir=runs/peers

Every configuration runs in a fresh process (tools/bench/worker.py) on synthetic data (or
--dataset=digits / tfds:NAME): warm-up steps untimed, then each step timed alone; images/s is
the median over the timed steps (of all --repeats rounds) with p10-p90. Beside our `single`/`data` runs the same work
runs under Keras `model.fit` (same MirroredStrategy) and PyTorch DDP (if installed). Writes
results.csv, results.json, results.md (the paper's table, every configuration, ours against
the peers) and speedup.png, throughput.png, memory.png into --out_dir.

Logical CPU devices (--cpu_devices, or a machine without GPUs) share the same cores: they
show overhead and memory per device, not multi-device speedup.
"""

import datetime
import os
import platform

from absl import flags

from tf_multigpu import cli
from tf_multigpu.config.workload_flags import check_workload_flags, define_workload_flags
from tf_multigpu.errors import UsageError

PROG = "benchmark"

flags.DEFINE_string("out_dir", None, "Directory for results.csv/json/md, the PNG plots and worker logs (required).")
flags.DEFINE_boolean("paper", False, "The paper's five configurations (1; 2 data; 2 model; 4 data; 4 hybrid "
                     "2x2), AlexNet, global batch 256 (--models/--batch_sizes override).")
flags.DEFINE_boolean("smoke", False, "A tiny sweep for CI: small_convnet at 16x16, 1-2 devices, batch 32, "
                     "1 warm-up and 3 timed steps.")
flags.DEFINE_list("strategies", ["single", "data", "model", "hybrid"], "Strategies to sweep.")
flags.DEFINE_list("devices", ["1", "2", "4"], "Device counts to sweep.")
flags.DEFINE_list("batch_sizes", ["64", "128", "256", "512"], "GLOBAL batch sizes to sweep.")
flags.DEFINE_list("models", ["alexnet", "small_convnet"], "Models to sweep (registry names).")
_WORKLOAD = define_workload_flags(("dataset", "image_size"), dataset="synthetic")   # models, batches: lists below
flags.DEFINE_integer("warmup_steps", 3, "Untimed steps before timing (tracing, allocation).")
flags.DEFINE_integer("timed_steps", 10, "Steps timed one by one; the median and p10/p90 are reported.")
flags.DEFINE_integer("repeats", 1, "Run the whole sweep this many times, round after round, pooling each "
                     "configuration's timed steps (steadier numbers on a shared machine).")
flags.DEFINE_integer("cpu_devices", 0, "Run on N logical CPU devices (>= the largest device count). "
                     "0: GPUs if any, else logical CPUs.")
flags.DEFINE_integer("threads", 0, "CPU threads per run, the same budget for every framework (0: all cores).")
flags.DEFINE_list("peers", ["keras_fit", "torch_ddp"], "Peers to time beside our single/data runs "
                  "(keras_fit, torch_ddp; --peers= for none).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Compute dtype of our runs and "
                  "Keras fit's (mixed precision); the PyTorch peer runs float32 only and is skipped otherwise.")
flags.DEFINE_boolean("xla", False, "XLA-compile our step and Keras fit's (jit_compile).")
flags.DEFINE_integer("timeout_s", 1800, "Give up on one configuration after this many seconds.")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
    settings = settings_from_flags()
    from tools.bench.sweep import run_sweep
    paths = run_sweep(settings)
    print("\n".join(paths))


def settings_from_flags() -> dict:
    """The sweep's settings from the flags, validated (UsageError, one line)."""
    if not FLAGS.out_dir:
        raise UsageError("--out_dir is required: give a directory for the tables and plots")
    if FLAGS.paper and FLAGS.smoke:
        raise UsageError("--paper and --smoke are different sweeps: give one of them")
    # Flags a sweep would silently ignore are refused instead.
    fixed = {"paper": ("strategies", "devices"),
             "smoke": ("strategies", "devices", "batch_sizes", "models")}
    for mode, names in fixed.items():
        given = [f"--{n}" for n in names if FLAGS[mode].value and FLAGS[n].present]
        if given:
            raise UsageError(f"--{mode} sets its own configurations: drop {', '.join(given)} "
                             f"(or drop --{mode} to sweep a grid)")
    check_workload_flags()
    cli.refuse_earlier_results("--out_dir", FLAGS.out_dir, ("results.csv", "results.json", "results.md",
                                                            "worker_logs.txt"))
    for name, low in (("warmup_steps", 0), ("timed_steps", 1), ("repeats", 1), ("cpu_devices", 0), ("threads", 0),
                      ("timeout_s", 1)):
        if FLAGS[name].value < low:
            raise UsageError(f"--{name}={FLAGS[name].value} must be >= {low}")
    s = {
        "mode": "paper" if FLAGS.paper else "smoke" if FLAGS.smoke else "grid",
        "strategies": FLAGS.strategies, "devices": _ints("devices"), "batch_sizes": _ints("batch_sizes"),
        "models": FLAGS.models, "dataset": FLAGS.dataset, "image_size": FLAGS.image_size,
        "warmup_steps": FLAGS.warmup_steps, "timed_steps": FLAGS.timed_steps, "cpu_devices": FLAGS.cpu_devices,
        "repeats": FLAGS.repeats, "threads": FLAGS.threads or os.cpu_count(), "peers": FLAGS.peers,
        "timeout_s": FLAGS.timeout_s,
        "out_dir": FLAGS.out_dir, "dtype": FLAGS.dtype, "xla": FLAGS.xla,
    }
    if FLAGS.paper:
        s["models"] = FLAGS.models if FLAGS["models"].present else ["alexnet"]
        s["batch_sizes"] = s["batch_sizes"] if FLAGS["batch_sizes"].present else [256]
    if FLAGS.smoke:
        s.update(strategies=["single", "data", "model"], devices=[1, 2], batch_sizes=[32], models=["small_convnet"],
                 image_size=FLAGS.image_size or (16 if FLAGS.dataset == "synthetic" else 0),
                 warmup_steps=FLAGS.warmup_steps if FLAGS["warmup_steps"].present else 1,
                 timed_steps=FLAGS.timed_steps if FLAGS["timed_steps"].present else 3)
    s["machine"] = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "date": datetime.date.today().isoformat()}
    return s


def _ints(name):
    try:
        return [int(v) for v in FLAGS[name].value]
    except ValueError:
        raise UsageError(f"--{name}={','.join(FLAGS[name].value)} must be comma-separated integers, "
                         f"e.g. --{name}={'1,2,4' if name == 'devices' else '64,128'}") from None


def _fail(message: str, status: int = cli.USAGE_ERROR):
    cli.fail(PROG, message, status)


def run():
    """Entry point: `python -m tools.benchmark`."""
    cli.run(main, PROG, _WORKLOAD)   # the tool's own flags are listed by --help already


if __name__ == "__main__":
    run()
