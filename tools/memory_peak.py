"""What is alive at the allocator's peak of a profiled run (RQ5: where a step's memory goes).

    python -m tools.memory_peak --run_dir=RUN_DIR [--top=30]

Reads RUN_DIR/tensorboard's newest profiler trace (train with --profile_steps=A,B), replays
its allocation events to the allocator's peak, and prints, per allocator, the bytes in use when
the trace began (weights, slots and whatever else was allocated before it), the peak, the op
whose allocation reached it, and the allocations made inside the trace that are alive at the
peak, by op (`profiling/xspace.allocations_at_peak`). TensorFlow records allocation
events for GPUs, and for CPUs with oneDNN's kernels (TF_ENABLE_ONEDNN_OPTS=1), not with its own.
"""

from absl import flags

from tf_multigpu import cli
from tf_multigpu.config import RunPaths

PROG = "memory_peak"

flags.DEFINE_string("run_dir", None, "The --run_dir of a run trained with --profile_steps=A,B (required).")
flags.DEFINE_integer("top", 30, "How many groups of allocations to list per allocator.", lower_bound=1)
FLAGS = flags.FLAGS


def to_markdown(peaks: dict, top: int) -> str:
    mib = 2**20
    lines = []
    for allocator, p in peaks.items():
        alive = sum(b for _, _, b in p["alive"])
        lines += [f"## Allocator {allocator}", "",
                  f"In use when the trace began {p['start_bytes'] / mib:,.1f} MiB; "
                  f"peak {p['peak_bytes'] / mib:,.1f} MiB, reached by `{p['peak_op']}`; "
                  "allocated in the trace and alive at the peak: "
                  f"{alive / mib:,.1f} MiB in {sum(c for _, c, _ in p['alive'])} tensors.", "",
                  "| op | tensors | MiB |", "| --- | ---: | ---: |"]
        lines += [f"| `{op}` | {count} | {size / mib:,.1f} |" for op, count, size in p["alive"][:top]]
        lines.append("")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments {argv[1:]}: give the run as --run_dir=RUN_DIR")
    if not FLAGS.run_dir:
        cli.fail(PROG, "--run_dir is required: give a run trained with --profile_steps=A,B")
    from tf_multigpu.profiling import xspace
    trace = xspace.latest_trace(RunPaths(FLAGS.run_dir).tensorboard)   # before TensorFlow starts: the error in 0.1 s
    if trace is None:
        cli.fail(PROG, f"no profiler trace under {RunPaths(FLAGS.run_dir).tensorboard}: train the run with "
                       "--profile_steps=A,B")
    cli.start_tensorflow()   # its protobuf reads the trace
    try:
        peaks = xspace.allocations_at_peak(trace)
    except ValueError as e:
        cli.fail(PROG, f"{e}: train the run again with --profile_steps=A,B")
    if not peaks:
        cli.fail(PROG, f"{trace} has no allocation events: TensorFlow records them for GPUs, and for CPUs with "
                       "oneDNN's kernels only: train again with TF_ENABLE_ONEDNN_OPTS=1")
    print(to_markdown(peaks, FLAGS.top), end="")


def run():
    """Entry point: `python -m tools.memory_peak`."""
    cli.run(main, PROG)


if __name__ == "__main__":
    run()
