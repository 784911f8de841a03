"""tf-multigpu-plan: predict and rank every parallelism plan for a model on some devices
(also `python -m tf_multigpu.plan_main`).

Intentionally short: parse flags, build the plain model for the data set's input shape, get
a device profile (a shipped one by name, a JSON file, or `measure` the devices here), and
print the planner's ranked table (and, for a profile fitted to a published table, that table
beside the predictions); --out_dir also writes plan.md and plan.json. Bad input
prints one line and exits 2. The flags that describe the workload have the same names and
meaning as tf-multigpu-train's.
"""

import json
import os

from absl import flags

from tf_multigpu import cli
from tf_multigpu.config.config import ALL_REDUCE
from tf_multigpu.config.workload_flags import check_workload_flags, define_workload_flags
from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.layouts import parse_rules  # pure Python
from tf_multigpu.planner.device_profile import builtin_names  # pure Python

PROG = "tf-multigpu-plan"

_WORKLOAD = define_workload_flags()   # the data set gives the input shape and classes
flags.DEFINE_string("profile", "measure", f"A shipped device profile ({', '.join(builtin_names())}), "
                    "a path to a profile .json, or "
                    "'measure' to benchmark the devices of this machine for a few seconds. yadan2013 and "
                    "p100_dgx1 also print their published table beside the planner's predictions.")
flags.DEFINE_string("all_reduce", "auto", "The gradient reduction a data-parallel run would use, as "
                    "tf-multigpu-train's --all_reduce (auto: the profile's default algorithm).")
flags.DEFINE_integer("num_devices", 0, "Devices to plan for (0: the profile's devices, or all found).")
flags.DEFINE_integer("cpu_devices", 0, "With --profile=measure: measure N logical CPU devices instead of GPUs.")
flags.DEFINE_float("grad_overlap", 0.0, "Fraction of the gradient all-reduce assumed hidden behind compute.")
flags.DEFINE_string("out_dir", None, "Also write plan.md and plan.json here.")
flags.DEFINE_string("layout_overrides", "", "Amend every model and hybrid plan's layout, as tf-multigpu-train's "
                    "--layout_overrides: 'REGEX=SPEC;...' over variable paths (e.g. "
                    "'.*stem/kernel=-,-,-,-' keeps a layer whose filters do not divide whole).")
FLAGS = flags.FLAGS
_ZERO_MEANS = {"num_devices": "the profile's devices, or all found", "cpu_devices": "GPUs, or the CPU"}
_OWN_FLAGS = _WORKLOAD + ("profile", "all_reduce", "num_devices", "cpu_devices", "grad_overlap", "out_dir",
                          "layout_overrides")


def main(argv):
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
    table = _plan()
    from tf_multigpu.planner import published, to_markdown
    text = to_markdown(table)
    if table.profile.name in published.TABLES:
        text += "\n" + published.to_markdown(table.profile.name, table.profile)
    print(text, flush=True)
    if FLAGS.out_dir:
        try:
            os.makedirs(FLAGS.out_dir, exist_ok=True)
            with open(os.path.join(FLAGS.out_dir, "plan.md"), "w") as f:
                f.write(text)
            with open(os.path.join(FLAGS.out_dir, "plan.json"), "w") as f:
                json.dump(table.to_dict(), f, indent=2)
        except OSError as e:
            _fail(f"cannot write to --out_dir={FLAGS.out_dir} ({e.strerror}): give a writable directory")


def _plan():
    """The ranked table for the flags (UsageError on bad input)."""
    # What the flags decide, before TensorFlow starts (the planner's profiles and algorithms
    # are pure Python).
    check_workload_flags()
    for name in ("num_devices", "cpu_devices"):
        if FLAGS[name].value < 0:
            raise UsageError(f"--{name}={FLAGS[name].value} must be >= 0 (0: {_ZERO_MEANS[name]})")
    if not 0 <= FLAGS.grad_overlap <= 1:
        raise UsageError(f"--grad_overlap={FLAGS.grad_overlap} must be in [0, 1], e.g. --grad_overlap=0.5")
    from tf_multigpu import planner
    if FLAGS.all_reduce not in ALL_REDUCE:
        raise UsageError(f"unknown --all_reduce={FLAGS.all_reduce!r}: choose one of {', '.join(ALL_REDUCE)}")
    if FLAGS.out_dir:
        cli.refuse_earlier_results("--out_dir", FLAGS.out_dir, ("plan.md", "plan.json"))
    overrides = parse_rules(FLAGS.layout_overrides, "--layout_overrides")
    profile = None
    if FLAGS.profile != "measure":
        if FLAGS.cpu_devices:
            raise UsageError("--cpu_devices applies to --profile=measure only: drop it or measure")
        profile = planner.load(FLAGS.profile)
    cli.start_tensorflow()
    devices = None
    if profile is None:   # before anything runs an op: logical devices cannot be made after
        from tf_multigpu.parallel import configure_devices
        devices = configure_devices(FLAGS.num_devices, FLAGS.cpu_devices)
    from tf_multigpu.data import load_source
    from tf_multigpu.models import build_model, get_factory
    get_factory(FLAGS.model)
    source = load_source(FLAGS.dataset, FLAGS.data_dir, FLAGS.image_size)
    model = build_model(FLAGS.model, source.image_shape, source.num_classes)
    if devices is not None:
        profile = planner.measure_for_run(devices, model, source, FLAGS.batch_size)
        num_devices = len(devices)
    else:
        num_devices = FLAGS.num_devices or profile.num_devices
        if not num_devices:
            raise UsageError(f"profile {profile.name} does not say how many devices it has: give --num_devices")
    cost = planner.analyze(model)
    return planner.plan_table(cost, profile, num_devices, FLAGS.batch_size,
                              planner.Assumptions(grad_overlap=FLAGS.grad_overlap,
                                                  all_reduce="" if FLAGS.all_reduce == "auto" else FLAGS.all_reduce),
                              overrides)


def _fail(message: str, status: int = cli.USAGE_ERROR):
    cli.fail(PROG, message, status)


def run():
    """Console-script entry point."""
    cli.run(main, PROG, _OWN_FLAGS)


if __name__ == "__main__":
    run()
