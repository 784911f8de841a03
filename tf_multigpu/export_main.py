"""tf-multigpu-export: export a run's checkpoint as a SavedModel (also
`python -m tf_multigpu.export_main`).

Intentionally short: parse flags and call `tf_multigpu.export.export_from_checkpoint`. The
export is the same as the one a training run writes at its end, from whatever strategy
trained it. Bad input prints one line and exits 2; on success one JSON line describes the
export. The flags are defined here, not in config/flags.py: they belong to this command
only, and importing the training flags would put them all in --help.
"""

import json

from absl import flags

from tf_multigpu import cli
from tf_multigpu.config import check_exportable_run

PROG = "tf-multigpu-export"

flags.DEFINE_string("run_dir", None, "The --run_dir of a training run (required).")
flags.DEFINE_string("checkpoint", None, "Checkpoint prefix to export, e.g. RUN_DIR/checkpoints/ckpt-100, "
                    "or a directory meaning its latest checkpoint (default: the run's latest).")
flags.DEFINE_string("export_dir", None, "Where to write the export (default: RUN_DIR/export). An "
                    "earlier export there is replaced only once the new one is complete.")
flags.DEFINE_bool("evaluate", True, "Measure the exported weights on the test split for the metadata "
                  "(--noevaluate skips it on large test sets; the metrics are then empty).")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
    if not FLAGS.run_dir:
        _fail("--run_dir is required: give the --run_dir of a training run")
    check_exportable_run(FLAGS.run_dir, FLAGS.checkpoint, FLAGS.export_dir)   # what the files decide, before TF
    cli.start_tensorflow()
    from tf_multigpu.export import export_from_checkpoint  # imports TensorFlow
    result = export_from_checkpoint(FLAGS.run_dir, FLAGS.checkpoint, FLAGS.export_dir, FLAGS.evaluate)
    print(json.dumps({k: result[k] for k in ("export_dir", "checkpoint", "step", "metrics")},
                     sort_keys=True), flush=True)


def _fail(message: str, status: int = cli.USAGE_ERROR):
    cli.fail(PROG, message, status)


_OWN_FLAGS = ("run_dir", "checkpoint", "export_dir", "evaluate")


def run():
    """Console-script entry point."""
    cli.run(main, PROG, _OWN_FLAGS)


if __name__ == "__main__":
    run()
