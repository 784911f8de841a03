"""Rebuild and print the communication report of a profiled run.

    python -m tools.comm_report --run_dir=RUN_DIR

Reads RUN_DIR/tensorboard's newest profiler trace and the collectives saved at training time
(RUN_DIR/comm_report.json), rewrites RUN_DIR/comm_report.{json,md} and prints the Markdown.
The run must have been trained with --profile_steps=A,B.
"""

from absl import flags

from tf_multigpu import cli
from tf_multigpu.config import RunPaths

PROG = "comm_report"

flags.DEFINE_string("run_dir", None, "The --run_dir of a run trained with --profile_steps=A,B (required).")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments {argv[1:]}: give the run as --run_dir=RUN_DIR")
    if not FLAGS.run_dir:
        cli.fail(PROG, "--run_dir is required: give a run trained with --profile_steps=A,B")
    try:   # decided before TensorFlow starts: the error in 0.1 s, not 6
        RunPaths(FLAGS.run_dir).saved_comm_report()
    except FileNotFoundError as e:
        cli.fail(PROG, str(e))
    cli.start_tensorflow()
    from tf_multigpu.profiling import report
    try:
        result = report.rebuild(FLAGS.run_dir)
    except FileNotFoundError as e:
        cli.fail(PROG, str(e))
    print(report.to_markdown(result), end="")


def run():
    """Entry point: `python -m tools.comm_report`."""
    cli.run(main, PROG)


if __name__ == "__main__":
    run()
