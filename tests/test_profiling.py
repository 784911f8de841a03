"""--profile_steps: a TensorBoard trace of the chosen steps and a communication report whose
numbers are checked against the model: gradient bytes for data parallelism, the split
layers' activations for model parallelism, nothing for one device; and profiling changes no
result."""

import glob
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import run_cli
from tests.helpers import checkpoint_values
from tests.launcher import run_module
from tf_multigpu.profiling import xspace

SMALL_CONVNET_PARAMS = 226_570
# small_convnet on 8x8 digits, filter_split on `model`: the outputs that are gathered are
# conv1 (8x8x32), pool2 (4x4x64), pool3 (2x2x128) and fc1 (256) floats per example.
SPLIT_OUTPUT_FLOATS = 8 * 8 * 32 + 4 * 4 * 64 + 2 * 2 * 128 + 256 + 10   # ... and the logits, for the accuracy
CONV_PARAMS = (3 * 3 * 1 * 32 + 32) + (3 * 3 * 32 * 64 + 64) + (3 * 3 * 64 * 128 + 128)
BATCH = 64   # the global batch of conftest.profiled_runs

pytestmark = pytest.mark.slow


def _report(run_dir):
    with open(os.path.join(run_dir, "comm_report.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name, devices", [("data2", 2), ("data4", 4), ("data2_float16", 2)])
def test_data_parallel_report_counts_the_gradient_all_reduce(profiled_runs, name, devices):
    """float16's loss scaling all-reduces the (float32) gradients inside a `cond` branch, the
    one a step with finite gradients takes: counted as at float32."""
    report = _report(profiled_runs[name])
    assert [s["step"] for s in report["steps"]] == [3, 4]
    assert all(s["collective_events"] > 0 and s["communication_ms"] > 0 for s in report["steps"])
    assert all(abs(s["compute_ms"] + s["communication_ms"] - s["step_ms"]) < 1e-6 for s in report["steps"])
    grads = report["bytes_per_device"]["gradients"]
    trainable_bytes = SMALL_CONVNET_PARAMS * 4
    assert grads["payload_bytes"] == trainable_bytes
    assert grads["moved_bytes"] == pytest.approx(trainable_bytes * 2 * (devices - 1) / devices)
    assert grads["minimum_bytes"] == pytest.approx(grads["moved_bytes"])
    assert report["bytes_per_device"]["activations"]["moved_bytes"] == 0
    assert not [c for c in report["collectives"] if c["op_type"] == "AddN"]   # no star read into a ring


def test_a_conds_collectives_are_those_of_its_branch_that_moves_most(devices):
    """One branch of a cond runs: the report counts the one that moves the most bytes (the
    update's, under float16's loss scaling), first or second, nested, or a switch_case's."""
    from tf_multigpu.profiling.collectives import from_function_graph

    def all_reduce(n):
        with tf.device(devices[0]):
            return tf.reduce_sum(tf.raw_ops.CollectiveReduceV2(
                input=tf.zeros([n]), group_size=2, group_key=1, instance_key=n, ordering_token=[],
                merge_op="Add", final_op="Id"))

    @tf.function
    def step(pred, index):
        a = tf.cond(pred, lambda: all_reduce(10),
                    lambda: tf.cond(pred, lambda: all_reduce(1000), lambda: all_reduce(100)))   # nested
        b = tf.switch_case(index, [lambda: tf.constant(0.0), lambda: all_reduce(50), lambda: all_reduce(20)])
        return a + b + all_reduce(7)

    graph = step.get_concrete_function(tf.TensorSpec([], tf.bool), tf.TensorSpec([], tf.int32)).graph
    found = from_function_graph(graph, devices[0])
    assert sorted(c.payload_bytes // 4 for c in found) == [7, 50, 1000], [(c.name, c.payload_bytes) for c in found]
    assert {c.group_size for c in found} == {2}


def test_reduction_to_one_device_is_counted_from_its_copies(profiled_runs):
    """`--all_reduce=one_device` runs no collective op: per gradient, 3 copies into the first
    of 4 devices, an AddN there, and one copy back to each other device. The report counts
    those copies from the step's graph: the ring's bytes on average, 3 gradients sent by the
    first device."""
    report = _report(profiled_runs["data4_star"])
    grads = report["bytes_per_device"]["gradients"]
    trainable_bytes = SMALL_CONVNET_PARAMS * 4
    stars = [c for c in report["collectives"] if c["kind"] == "gradients"]
    assert {(c["op_type"], c["group_size"], c["copies_in"], c["copies_out"]) for c in stars} == {("AddN", 4, 3, 3)}
    assert len(stars) == len(report["collectives"])   # the loss sums the host reads are no all-reduces
    assert grads["payload_bytes"] == trainable_bytes and grads["ops"] == len(stars) > 1
    assert grads["moved_bytes"] == pytest.approx(trainable_bytes * 2 * 3 / 4)
    assert grads["busiest_sent_bytes"] == pytest.approx(trainable_bytes * 3)
    assert grads["minimum_bytes"] == pytest.approx(grads["moved_bytes"])


def test_trace_holds_named_gradient_all_reduces_and_steps(profiled_runs):
    """The trace is the profiler's own XSpace, with step markers and the all-reduce under
    allreduce/gradients; TensorBoard gets the report's scalars."""
    trace = xspace.latest_trace(os.path.join(profiled_runs["data2"], "tensorboard"))
    from tf_multigpu.compat import xplane_pb2
    space = xplane_pb2().XSpace()
    space.ParseFromString(open(trace, "rb").read())
    names = {m.name for p in space.planes for m in p.event_metadata.values()}
    assert "train" in names
    assert any("allreduce/gradients" in n and n.endswith(":CollectiveReduceV2") for n in names), sorted(names)[:50]
    tags = set()
    for path in glob.glob(os.path.join(profiled_runs["data2"], "tensorboard", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(v.tag for v in event.summary.value)
    assert {"communication/communication_ms", "communication/gradients_moved_bytes_per_device"} <= tags


def test_model_parallel_report_counts_the_split_layers_activations(profiled_runs):
    report = _report(profiled_runs["model2"])
    gathers = report["forward_activation_gathers"]
    assert gathers["analytic_payload_bytes"] == BATCH * SPLIT_OUTPUT_FLOATS * 4
    assert gathers["measured_payload_bytes"] == gathers["analytic_payload_bytes"]
    activations = report["bytes_per_device"]["activations"]
    assert activations["moved_bytes"] >= activations["minimum_bytes"] > 0
    assert report["bytes_per_device"]["gradients"]["moved_bytes"] == 0   # one group: nothing to sum
    assert all(s["communication_ms"] > 0 for s in report["steps"])


def test_conv_data_fc_model_report_counts_conv_gradients_and_the_batch_gather(profiled_runs):
    """Krizhevsky's trick on 4 devices: the conv weights' gradients are all-reduced over all
    4, and the batch is all-gathered before fc1 (flatten's 2x2x128 floats per example), as
    are fc1's split units before the classifier (256); backward, their gradients go back."""
    report = _report(profiled_runs["trick4"])
    grads = report["bytes_per_device"]["gradients"]
    assert grads["minimum_bytes"] == pytest.approx(CONV_PARAMS * 4 * 2 * 3 / 4)
    # DTensor combines them (and the logits' gather for the accuracy) into one all-reduce;
    # the report splits it into its parts.
    assert grads["moved_bytes"] == pytest.approx(grads["minimum_bytes"])
    gathers = report["forward_activation_gathers"]
    assert gathers["analytic_payload_bytes"] == BATCH * (2 * 2 * 128 + 256) * 4
    assert gathers["measured_payload_bytes"] == gathers["analytic_payload_bytes"]
    activations = report["bytes_per_device"]["activations"]
    assert activations["minimum_bytes"] == pytest.approx(2 * 3 / 4 * gathers["analytic_payload_bytes"])
    assert activations["moved_bytes"] >= activations["minimum_bytes"]
    assert report["bytes_per_device"]["parameters"]["moved_bytes"] == 0


def test_single_device_report_shows_no_communication(profiled_runs):
    report = _report(profiled_runs["single"])
    assert all(s["communication_ms"] == 0 and s["collective_events"] == 0 for s in report["steps"])
    assert all(t["moved_bytes"] == 0 and t["minimum_bytes"] == 0 for t in report["bytes_per_device"].values())


def test_profiling_does_not_change_the_result(profiled_runs):
    profiled, plain = checkpoint_values(profiled_runs["data2"]), checkpoint_values(profiled_runs["data2_plain"])
    assert profiled.keys() == plain.keys()
    for key in plain:
        np.testing.assert_array_equal(profiled[key], plain[key], err_msg=key)


def test_comm_report_tool_rebuilds_the_report(profiled_runs):
    done = run_module("tools.comm_report", f"--run_dir={profiled_runs['model2']}", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| activations |" in done.stdout and "| mean |" in done.stdout
    missing = run_module("tools.comm_report", f"--run_dir={profiled_runs['data2_plain']}", timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.startswith("comm_report: error: ") and len(missing.stderr.splitlines()) == 1, missing.stderr
    assert "train with --profile_steps=A,B first" in missing.stderr


def test_comm_report_reads_only_its_own_run_and_refuses_damaged_files(profiled_runs, tmp_path):
    """A copy of a run without its trace reported the ORIGINAL run's trace (the absolute path
    saved in comm_report.json); damaged files were tracebacks."""
    import shutil

    from tf_multigpu.errors import UsageError
    from tf_multigpu.profiling import report, xspace
    copy = str(tmp_path / "copy")
    shutil.copytree(profiled_runs["model2"], copy)
    trace = xspace.latest_trace(os.path.join(copy, "tensorboard"))
    assert report.rebuild(copy)["trace"] == trace   # the copy's own trace, not the original's
    open(trace, "wb").write(b"not a trace")
    with pytest.raises(UsageError, match="is not a profiler trace .*: train the run again"):
        report.rebuild(copy)
    shutil.rmtree(os.path.join(copy, "tensorboard", "plugins"))
    with pytest.raises(UsageError, match="holds no profiler trace"):
        report.rebuild(copy)
    for damage in ("{}", "garbage {"):
        open(os.path.join(copy, "comm_report.json"), "w").write(damage)
        with pytest.raises(UsageError, match="comm_report.json is damaged"):
            report.rebuild(copy)


@pytest.mark.parametrize("flags, needle", [
    (["--profile_steps=5,3"], "--profile_steps='5,3' is not A,B with 1 <= A <= B"),
    (["--profile_steps=a"], "is not A,B with 1 <= A <= B"),
    (["--profile_steps=4,9"], "--profile_steps=4,9 goes past the last step (5)"),
])
def test_bad_profile_steps_are_usage_errors(tmp_path, flags, needle):
    done = run_cli(f"--run_dir={tmp_path / 'run'}", "--steps=5", *flags)
    assert done.returncode == 2
    assert needle in done.stderr.strip().splitlines()[-1]


def test_resnet50_activation_bytes_measured_equal_the_plans(tmp_path):
    """keras.applications' ResNet-50 under model 1x2 filter_split: the forward all-gathers
    DTensor runs add up to what the placement plan says, to 1%. (A residual block's first conv
    and its projection shortcut read the same split tensor: DTensor merges their two gathers
    into one, and so does the plan.) The run trains ResNet-50 cut after its first blocks (32x32,
    batch 8), placed layer for layer as the whole (test_placement.py), with both kinds of
    block; the whole model's plan is pinned here without a run."""
    from tests.user_models import resnet50, resnet50_first_blocks
    from tf_multigpu.parallel.placement import make_plan
    from tf_multigpu.profiling.analytic import minimum_bytes
    mesh, logits = {"batch": 1, "model": 2}, 8 * 1000 * 4   # the split logits' gather for the accuracy
    whole = make_plan(resnet50((32, 32, 3), 1000), "filter_split", [], mesh)
    assert minimum_bytes(whole, 8)["forward_activation_payload"] == 5_537_792 + logits
    run_dir = tmp_path / "resnet50"
    done = run_cli(f"--run_dir={run_dir}", "--strategy=model", "--cpu_devices=2", "--dataset=synthetic",
                   "--image_size=32", "--model=tests.user_models:resnet50_first_blocks", "--batch_size=8",
                   "--steps=3", "--profile_steps=3,3", "--log_every=3", "--noexport", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    gathers = _report(run_dir)["forward_activation_gathers"]
    # Floats per example gathered forward: conv2_block1's first conv (and its shortcut, one gather),
    # its 3x3 and its last read 8x8x64; each identity block's first conv 8x8x256, its others
    # 8x8x64; conv3_block1's first (and shortcut) 8x8x256, its others 4x4x128; the classifier 512.
    floats = 3 * 8 * 8 * 64 + 2 * (8 * 8 * 256 + 2 * 8 * 8 * 64) + 8 * 8 * 256 + 2 * 4 * 4 * 128 + 512
    analytic = minimum_bytes(make_plan(resnet50_first_blocks((32, 32, 3), 1000), "filter_split", [], mesh), 8)
    assert gathers["analytic_payload_bytes"] == analytic["forward_activation_payload"] == 8 * floats * 4 + logits
    assert abs(gathers["measured_payload_bytes"] / gathers["analytic_payload_bytes"] - 1) <= 0.01, gathers


def test_layer_normalization_statistics_measured_equal_the_plans(tmp_path):
    """A LayerNormalization on split channels (model 1x2, 16x16, batch 8): the all-reduces
    DTensor's lowered step runs under its name are the plan's, two values per position forward
    (mean, variance) and two backward. The next convolution's all-reduce of its input gradient
    is the plan's too, and backward."""
    from tests.user_models import layernorm_convnet
    from tf_multigpu.parallel.placement import make_plan
    run_dir = tmp_path / "layernorm"
    done = run_cli(f"--run_dir={run_dir}", "--strategy=model", "--cpu_devices=2", "--dataset=synthetic",
                   "--image_size=16", "--model=tests.user_models:layernorm_convnet", "--batch_size=8",
                   "--steps=2", "--profile_steps=2,2", "--log_every=2", "--noexport", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    measured, gathered, conv2 = {True: 0, False: 0}, 0, []
    for c in _report(run_dir)["collectives"]:
        if "/norm_1/" in c["name"] and c["op"] == "all_reduce":
            measured[c["forward"]] += c["payload_bytes"]
        elif "/norm_1/" in c["name"]:   # conv2's gather of its input, which DTensor runs on its producer
            gathered += c["payload_bytes"]
        elif "/conv2_1/" in c["name"] and c["payload_bytes"] > 4:   # not the scalar that orders
            conv2.append((c["op"], c["forward"], c["payload_bytes"]))  # its chunks (split_conv.zero_from)
    plan = make_plan(layernorm_convnet((16, 16, 3), 1000), "filter_split", [], {"batch": 1, "model": 2})
    planned = {c.phase == "forward": 8 * c.elems_per_example * 4 for c in plan["norm"].collectives}
    assert measured == planned == {True: 8 * 2 * 16 * 16 * 4, False: 8 * 2 * 16 * 16 * 4}
    assert gathered == 8 * plan["conv2"].collectives[0].elems_per_example * 4 == 8 * 16 * 16 * 8 * 4
    # SplitConv2D's all-reduce of its input gradient, which its custom gradient runs: backward,
    # under the layer's name (it was reported as forward, at the root, before)
    assert conv2 == [(c.op, c.phase == "forward", 8 * c.elems_per_example * 4)
                     for c in plan["conv2"].collectives if c.op == "all_reduce"] == [("all_reduce", False, 65536)]


def test_separable_convolutions_measured_collectives_equal_the_plans(tmp_path):
    """filter_split's separable convolutions (model 1x2, 16x16, batch 8): under each one's name
    DTensor's lowered step runs exactly the plan's all-reduce (forward for one on split
    channels, backward for one split on filters), and the forward gathers add up to the
    analytic payload (a merge's backward gather of its whole operand's gradient, under its own
    name scope, is not counted as forward)."""
    from tests.user_models import separable_convnet
    from tf_multigpu.parallel.placement import make_plan
    from tf_multigpu.profiling.analytic import minimum_bytes
    run_dir = tmp_path / "separable"
    done = run_cli(f"--run_dir={run_dir}", "--strategy=model", "--cpu_devices=2", "--dataset=synthetic",
                   "--image_size=16", "--model=tests.user_models:separable_convnet", "--batch_size=8",
                   "--steps=2", "--profile_steps=2,2", "--log_every=2", "--noexport", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = _report(run_dir)
    plan = make_plan(separable_convnet((16, 16, 3), 1000), "filter_split", [], {"batch": 1, "model": 2})
    names = [p.name for p in plan.layers if p.node.cls.__name__ == "SeparableConv2D"]
    measured = {n: sorted((c["op"], c["forward"], c["payload_bytes"]) for c in report["collectives"]
                          if f"/{n}_1/" in c["name"]) for n in names}
    planned = {n: sorted((c.op, c.phase == "forward", 8 * c.elems_per_example * 4) for c in plan[n].collectives)
               for n in names}
    assert measured == planned
    assert len(names) == 6 and all(len(v) == 1 for v in planned.values())
    gathers = report["forward_activation_gathers"]
    assert gathers["measured_payload_bytes"] == gathers["analytic_payload_bytes"] == \
        minimum_bytes(plan, 8)["forward_activation_payload"]
