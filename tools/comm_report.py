"""Rebuild and print the communication report of a profiled run.

    python tools/comm_report.py RUN_DIR

Reads RUN_DIR/tensorboard's newest profiler trace and the collectives saved at training time
(RUN_DIR/comm_report.json), rewrites RUN_DIR/comm_report.{json,md} and prints the Markdown.
The run must have been trained with --profile_steps=A,B.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

USAGE_ERROR = 2


def main(argv) -> int:
    if len(argv) != 2 or argv[1].startswith("-"):
        print("usage: comm_report.py RUN_DIR  (a run trained with --profile_steps=A,B)", file=sys.stderr)
        return USAGE_ERROR
    from tf_multigpu.profiling import report
    try:
        result = report.rebuild(argv[1])
    except FileNotFoundError as e:
        print(f"comm_report.py: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    print(report.to_markdown(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
