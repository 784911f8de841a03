"""Convergence comparison: test error against wall-clock time per configuration (Figure 1).

    python -m tools.convergence --out_dir=runs/convergence                # digits, small_convnet
    python -m tools.convergence --out_dir=runs/conv --configs=single:1,data:2 --steps=100

Trains each configuration (default: the paper's five) in a fresh `tf-multigpu-train`
process with the same data, model, global batch, seed and steps, evaluating every
--eval_every steps, and writes convergence.csv, convergence.md and convergence.png into
--out_dir (the runs themselves under --out_dir/runs/). On logical CPU devices the time axis
shows overhead, not multi-device speedup; the error axis shows that every strategy learns alike.
"""

from absl import flags

from tf_multigpu import cli
from tf_multigpu.config.workload_flags import check_workload_flags, define_workload_flags
from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.mesh_spec import replicas_for

PROG = "convergence"

flags.DEFINE_string("out_dir", None, "Directory for convergence.csv/.md/.png and the runs (required).")
flags.DEFINE_string("configs", "single:1,data:2,model:2,data:4,hybrid:4",
                    "STRATEGY:DEVICES,... to compare (default: the paper's five configurations).")
# --batch_size must divide by every configuration's replicas.
_WORKLOAD = define_workload_flags(("model", "dataset", "image_size", "batch_size"))
flags.DEFINE_integer("steps", 300, "Training steps of every configuration.")
flags.DEFINE_integer("eval_every", 20, "Evaluate on the test split every N steps (the curve's points).")
flags.DEFINE_float("learning_rate", 0.05, "Peak SGD learning rate (cosine schedule, momentum 0.9).")
flags.DEFINE_integer("seed", 0, "Same seed: same initial weights and batches in every configuration.")
flags.DEFINE_integer("cpu_devices", 0, "Run on logical CPU devices (N >= each configuration's devices). "
                     "0: GPUs if any, else logical CPUs.")
flags.DEFINE_integer("timeout_s", 3600, "Give up on one configuration after this many seconds.")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
    if not FLAGS.out_dir:
        raise UsageError("--out_dir is required: give a directory for the curves and runs")
    check_workload_flags()
    cli.refuse_earlier_results("--out_dir", FLAGS.out_dir, ("convergence.csv", "convergence.md",
                                                            "convergence.png", "runs"))
    for name, low in (("steps", 1), ("eval_every", 1), ("cpu_devices", 0), ("timeout_s", 1)):
        if FLAGS[name].value < low:
            raise UsageError(f"--{name}={FLAGS[name].value} must be >= {low}")
    from tools.bench.convergence import parse_configs, run_convergence
    for strategy, n in parse_configs(FLAGS.configs):   # bad --configs: one line before anything trains
        replicas = replicas_for(strategy, n)
        if FLAGS.batch_size % replicas:
            raise UsageError(f"--batch_size={FLAGS.batch_size} does not divide by the {replicas} replicas of "
                             f"{strategy}:{n}: use a multiple of {replicas}")
    cli.start_tensorflow()   # quietly, for the progress bar and the curve reader (runs train apart)
    paths = run_convergence({name: FLAGS[name].value for name in (
        "out_dir", "configs", "dataset", "model", "image_size", "batch_size", "steps", "eval_every",
        "learning_rate", "seed", "cpu_devices", "timeout_s")})
    print("\n".join(paths))


def _fail(message: str, status: int = cli.USAGE_ERROR):
    cli.fail(PROG, message, status)


def run():
    """Entry point: `python -m tools.convergence`."""
    cli.run(main, PROG, _WORKLOAD)   # the tool's own flags are listed by --help already


if __name__ == "__main__":
    run()
