"""The largest global batch that fits per strategy on the given devices (RQ5).

    python -m tools.max_batch --model=alexnet --dataset=synthetic --device_memory_limit=8000 \\
        --strategies=single,data,model,hybrid --num_devices=4 --out_dir=results/max_batch

Each probe is a fresh `tf-multigpu-train --steps=1 --noexport` run with the given
--device_memory_limit: exit status 0 means the batch fits, 3 that it does not (out of memory
on a GPU; on CPUs, the run's estimated bytes per device exceed the limit). The batch doubles
from the replica count until a probe fails, then a bisection on multiples of the replica
count finds the boundary to within --resolution images. Writes max_batch.json and max_batch.md.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import flags

from tf_multigpu import cli
from tf_multigpu.cli import DOES_NOT_FIT
from tf_multigpu.config.workload_flags import check_workload_flags, define_workload_flags
from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.mesh_spec import replicas_for

PROG = "max_batch"
PROBE_FAILED = 1
# synthetic: ImageNet-shaped, 4,096 training images. --batch_size is what this tool searches for.
_WORKLOAD = define_workload_flags(("model", "dataset", "image_size"), model="alexnet", dataset="synthetic")
flags.DEFINE_list("strategies", ["single", "data", "model", "hybrid"], "Strategies to probe.")
flags.DEFINE_integer("num_devices", 0, "Devices for data/model/hybrid (0: all).")
flags.DEFINE_integer("cpu_devices", 0, "Logical CPU devices instead of GPUs (0: GPUs if any).")
flags.DEFINE_integer("device_memory_limit", None, "MiB per device (required).")
flags.DEFINE_integer("start_batch", 16, "First batch probed (rounded up to the replica count).")
flags.DEFINE_integer("max_batch", 4096, "Stop doubling here.")
flags.DEFINE_integer("resolution", 16, "Stop bisecting when the boundary is known to within this many images.")
flags.DEFINE_string("out_dir", "results/max_batch", "Where max_batch.json and max_batch.md go.")
flags.DEFINE_integer("timeout", 900, "Seconds per probe.")
FLAGS = flags.FLAGS
FITS = 0


def probe(strategy: str, batch: int) -> bool:
    """Whether one training step of `batch` runs within the memory limit."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "tf_multigpu.train", f"--run_dir={run_dir}", "--steps=1", "--noexport",
                   f"--strategy={strategy}", f"--model={FLAGS.model}", f"--dataset={FLAGS.dataset}",
                   f"--image_size={FLAGS.image_size}", f"--batch_size={batch}",
                   f"--device_memory_limit={FLAGS.device_memory_limit}", f"--cpu_devices={FLAGS.cpu_devices}"]
        if strategy != "single":
            command.append(f"--num_devices={FLAGS.num_devices}")
        done = subprocess.run(command, capture_output=True, text=True, timeout=FLAGS.timeout)
    if done.returncode not in (FITS, DOES_NOT_FIT):
        cli.fail(PROG, f"probe {strategy} batch {batch} failed: "
                       f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}",
                 PROBE_FAILED)
    print(f"  {strategy:7s} batch {batch:6d}: {'fits' if done.returncode == FITS else 'does not fit'}", flush=True)
    return done.returncode == FITS


def largest_batch(strategy: str, replicas: int) -> int:
    """The largest multiple of `replicas` (<= --max_batch) that fits; 0 if none does."""
    low, high = 0, -(-max(FLAGS.start_batch, replicas) // replicas) * replicas
    while high <= FLAGS.max_batch and probe(strategy, high):
        low, high = high, high * 2
    if high > FLAGS.max_batch:
        return low
    while high - low > max(replicas, FLAGS.resolution):   # invariant: low fits (or is 0), high does not
        middle = (low + high) // 2 // replicas * replicas
        if probe(strategy, middle):
            low = middle
        else:
            high = middle
    return low


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
    check_workload_flags()
    if not FLAGS.device_memory_limit or FLAGS.device_memory_limit < 1:
        raise UsageError("--device_memory_limit=MiB is required, e.g. --device_memory_limit=8000")
    cli.refuse_earlier_results("--out_dir", FLAGS.out_dir, ("max_batch.json", "max_batch.md"))
    devices = FLAGS.num_devices or FLAGS.cpu_devices or 1
    rows = []
    for strategy in FLAGS.strategies:
        batch = largest_batch(strategy, replicas_for(strategy, devices))
        rows.append({"strategy": strategy, "devices": 1 if strategy == "single" else devices,
                     "largest_global_batch": batch})
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    settings = {k: FLAGS[k].value for k in ("model", "dataset", "image_size", "device_memory_limit", "cpu_devices")}
    with open(os.path.join(FLAGS.out_dir, "max_batch.json"), "w") as f:
        json.dump({"settings": settings, "rows": rows}, f, indent=2)
    table = [f"Largest global batch per strategy, {FLAGS.model}, {FLAGS.device_memory_limit} MiB per device",
             "", "| strategy | devices | largest global batch |", "| --- | ---: | ---: |"]
    table += [f"| {r['strategy']} | {r['devices']} | {r['largest_global_batch']} |" for r in rows]
    with open(os.path.join(FLAGS.out_dir, "max_batch.md"), "w") as f:
        f.write("\n".join(table) + "\n")
    print("\n".join(table))


def run():
    """Entry point: `python -m tools.max_batch`."""
    cli.run(main, PROG, _WORKLOAD)   # the tool's own flags are listed by --help already


if __name__ == "__main__":
    run()
