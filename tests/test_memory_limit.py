"""--device_memory_limit (RQ5): a run that does not fit says so in one line with exit status 3
before writing anything, and `python -m tools.max_batch` finds the largest global batch that fits."""

import json
import os

import pytest

from tests.conftest import run_cli
from tests.launcher import run_module
from tf_multigpu.cli import DOES_NOT_FIT


def test_a_run_over_the_memory_limit_exits_3_and_names_the_largest_batch(tmp_path):
    run_dir = tmp_path / "run"
    done = run_cli(f"--run_dir={run_dir}", "--cpu_devices=2", "--batch_size=1024", "--device_memory_limit=16",
                   "--steps=1")
    assert done.returncode == DOES_NOT_FIT, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert "needs about 35 MiB per device but --device_memory_limit=16: use --batch_size<=426," in line, line
    assert not run_dir.exists()   # nothing written


def test_the_same_run_within_the_limit_trains(tmp_path):
    done = run_cli(f"--run_dir={tmp_path / 'run'}", "--cpu_devices=2", "--batch_size=64", "--device_memory_limit=16",
                   "--steps=1", "--noexport")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["memory_per_device_bytes"]["total"] <= 16 * 2**20 and summary["export_dir"] is None


def test_logical_gpus_need_a_memory_limit(tmp_path):
    done = run_cli(f"--run_dir={tmp_path / 'run'}", "--logical_gpus=2")
    assert done.returncode == 2
    assert "--logical_gpus=2 needs --device_memory_limit=MiB" in done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_max_batch_finds_the_boundary(tmp_path):
    done = run_module("tools.max_batch", "--model=small_convnet", "--dataset=digits", "--device_memory_limit=16",
                      "--strategies=data", "--cpu_devices=2", "--start_batch=256", "--max_batch=1024",
                      "--resolution=128", f"--out_dir={tmp_path}", timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.load(open(os.path.join(tmp_path, "max_batch.json")))["rows"]
    # The estimate allows 426 for small_convnet on 2 devices with 16 MiB: 256 fits, 512 does not,
    # and the bisection at a resolution of 128 stops at 384, which fits.
    assert rows == [{"strategy": "data", "devices": 2, "largest_global_batch": 384}]
    assert "| data | 2 | 384 |" in open(os.path.join(tmp_path, "max_batch.md")).read()


def test_packed_all_reduce_peaks_in_one_phase_and_largest_batch_is_the_boundary():
    """Data parallelism's one packed all-reduce waits for the whole backward and the update
    for it: the estimate's total is the persistent parts and the gradients plus the largest
    phase, where a model-only mesh's (and one device's) is the sum. largest_batch is the boundary of
    that same total, whichever form it takes."""
    from tf_multigpu.models import build_model
    from tf_multigpu.parallel.memory import bytes_per_device, largest_batch
    from tf_multigpu.planner.cost_model import analyze, plan_for
    cost = analyze(build_model("alexnet", (224, 224, 3), 1000))
    data = bytes_per_device(plan_for(cost, None, {"batch": 2, "model": 1}), 64)
    persistent = data["parameters"] + data["optimizer_slots"] + data["input"] + data["gradients"]
    phases = (data["activations"] + data["transient"], data["reduction_buffers"], data["update"])
    assert data["total"] == persistent + max(phases) < sum(v for k, v in data.items() if k != "total")
    split = bytes_per_device(plan_for(cost, "filter_split", {"batch": 1, "model": 2}), 64)
    assert split["total"] == sum(v for k, v in split.items() if k != "total")
    for layout, mesh, step in ((None, {"batch": 2, "model": 1}, 2), ("filter_split", {"batch": 1, "model": 2}, 1)):
        plan = plan_for(cost, layout, mesh)
        limit = 2 * 2**30
        batch = largest_batch(plan, limit, step)
        assert batch > 0 and batch % step == 0
        assert bytes_per_device(plan, batch)["total"] <= limit < bytes_per_device(plan, batch + step)["total"]
    split_plan = plan_for(cost, "filter_split", {"batch": 1, "model": 2})
    assert largest_batch(split_plan, 2**20, 1) == 0   # its parameters alone are over 1 MiB


def test_a_hybrid_counts_its_updates_after_the_backward_one_at_a_time():
    """On a mesh with a `batch` axis, the gradients TensorFlow's own ops compute (Dense
    kernels, every bias) are all-reduced after the backward, in place, one after another, and
    each update waits for its own: the total is the persistent parts plus the larger of the
    backward (with the updates of the kernels SplitConv2D sums itself) and the largest of those
    updates, fc6's. --shard_optimizer_state keeps the sum (its Dense updates wait too, but its
    peak is the backward's: memory.py's `_updated_after_backward`)."""
    import dataclasses

    from tf_multigpu.models import build_model
    from tf_multigpu.parallel.memory import bytes_per_device
    from tf_multigpu.parallel.placement import BYTES_PER_VALUE
    from tf_multigpu.planner.cost_model import analyze, plan_for
    plan = plan_for(analyze(build_model("alexnet", (224, 224, 3), 1000)), "filter_split", {"batch": 2, "model": 2})
    slots = {path: plan.local_slot_elems(path, shape) * BYTES_PER_VALUE
             for layer in plan.layers for path, shape in layer.node.weights.items()}
    conv_kernels = sum(b for p, b in slots.items() if p.startswith("alexnet/conv") and p.endswith("kernel"))
    for momentum in (1, 0):
        parts = bytes_per_device(plan, 64, slots_per_parameter=momentum)
        persistent = parts["parameters"] + parts["optimizer_slots"] + parts["input"] + parts["gradients"]
        during = 2 * conv_kernels if momentum else conv_kernels   # SGD: the scaled gradient only
        after = (2 if momentum else 1) * slots["alexnet/fc6/kernel"]
        assert parts["reduction_buffers"] == 0
        assert parts["total"] == persistent + max(parts["activations"] + parts["transient"] + during, after)
        # with momentum fc6's update sets AlexNet's total; with plain SGD the backward does
        assert (after > parts["activations"] + parts["transient"] + during) == bool(momentum)
    sharded = bytes_per_device(dataclasses.replace(plan, shard_slots=True), 64)
    assert sharded["total"] == sum(v for k, v in sharded.items() if k != "total")
