"""Model and hybrid parallelism beyond parity: split shapes, memory, errors, training,
checkpoints across meshes. The in-process DTensor checks use the 1x4 mesh and are marked
`in_process_mesh`: a second mesh over other devices in one process can hang in an order never
run (BUILD_NOTES.md), so such tests share one process in file order (tests/conftest.py); other
meshes run as commands."""

import json
import os
import shutil
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from tests.conftest import run_cli
from tests.helpers import checkpoint_values, keep_only_checkpoint, serve_digits
from tests.launcher import run_code, run_module
from tf_multigpu.config import Config
from tf_multigpu.errors import UsageError
from tf_multigpu.models import build_model
from tf_multigpu.parallel.layouts import assign_specs, parse_rules
from tf_multigpu.parallel.memory import bytes_per_device, saved_elems
from tf_multigpu.parallel.placement import make_plan, model_graph, policy_rules
from tf_multigpu.profiling.analytic import minimum_bytes
from tf_multigpu.training.run import build_run

MESH_1X4 = "batch:1,model:4"


def _build(devices, model, dataset, layout="filter_split", strategy="model", mesh=MESH_1X4, n=4):
    run = build_run(Config(strategy=strategy, model=model, dataset=dataset, batch_size=32, steps=10,
                           mesh=mesh, layout=layout), devices[:n])
    return run.par, run.model, run.optimizer


@pytest.mark.in_process_mesh
def test_a_mesh_runs_batch_norm_as_the_lean_layer(devices):
    """Every stock BatchNormalization of a model- or hybrid-parallel model runs as
    LeanBatchNormalization (parallel/lean_batchnorm.py), with the stock layer's config."""
    from tf_multigpu.parallel.lean_batchnorm import LeanBatchNormalization
    par, model, optimizer = _build(devices, "tests.user_models:batchnorm_variants", "synthetic", n=2,
                                   mesh="batch:1,model:2")
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert [type(layer) for layer in norms] == [LeanBatchNormalization] * 3
    assert [(layer.scale, layer.center) for layer in norms] == [(False, True), (True, False), (False, False)]


@pytest.mark.in_process_mesh
def test_a_layer_that_cannot_be_made_from_its_config_is_one_line(devices):
    """Was a TypeError traceback from Keras' from_config (GatherScale's deserialisation)."""
    with pytest.raises(UsageError, match=r"layer \S+ \(_Scale\) cannot be made again from its get_config\(\) .*"
                                         r"pass its __init__'s \*\*kwargs on .* or use --strategy=data"):
        _build(devices, "tests.user_models:unconfigurable_layer_convnet", "digits", n=2, mesh="batch:1,model:2")
    # A split-aware layer's own refusal, raised in the same place, keeps its own fix.
    with pytest.raises(UsageError, match=r"layer dilated: dilation_rate=\(2, 2\) .*: replicate the layer") as e:
        _build(devices, "tests.user_models:dilated_depthwise_convnet", "digits", n=2, mesh="batch:1,model:2")
    assert "get_config" not in str(e.value)


@pytest.mark.in_process_mesh
def test_each_split_kernel_holds_one_mth_per_device(devices):
    par, model, optimizer = _build(devices, "alexnet", "synthetic")
    from tf_multigpu.parallel import Parallelism
    assert isinstance(par, Parallelism) and par.spmd_lowered
    split = [v for v in model.trainable_weights if par.plan.split_on_model(v.path)]
    assert {v.path.split("/")[1] for v in split} == {
        "conv1", "conv2", "conv3", "conv4", "conv5", "fc6", "fc7", "logits"}
    for v in split:
        assert np.prod(par.local_shape(v)) * 4 == np.prod(v.shape), v.path
    for slot in optimizer.variables:   # momentum slots follow their variables
        if len(slot.shape) == 4:
            assert par.local_shape(slot)[-1] * 4 == slot.shape[-1], slot.path


@pytest.mark.in_process_mesh
def test_layers_built_under_a_name_scope_are_split_as_planned(devices):
    """keras.name_scope (NASNet's cells) gives `block/conv2/kernel` in the model and
    `conv2/kernel` in its clone: such kernels stayed whole on every device while the plan
    (memory, communication) counted them split, or the step failed in SPMD expansion."""
    par, model, _ = _build(devices, "tests.user_models:scoped_convnet", "digits")
    assert par.plan.specs["block/conv2/kernel"] == ["-", "-", "-", "model"]
    assert par.plan.specs["block/dw/kernel"] == ["-", "-", "model", "-"]
    local = {v.path: par.local_shape(v) for v in model.trainable_weights}
    assert local["conv2/kernel"] == [3, 3, 8, 2] and local["dw/kernel"] == [3, 3, 2, 1], local


@pytest.mark.in_process_mesh
def test_weights_made_without_a_name_are_split_as_planned(devices):
    """ConvNeXt's LayerScale makes its weight without a name: Keras numbers it process-wide
    (`layer_scale/variable_18` in the model, `variable_36` in its clone), so the creator found
    no plan for it and the build failed its pairing check (it would have stayed whole)."""
    par, model, _ = _build(devices, "tests.user_models:applications_idioms", "digits")
    (gamma,) = model.get_layer("layer_scale").weights
    assert par.local_shape(gamma) == [2] and par.local_shape(model.get_layer("stem_ln").gamma) == [2]


@pytest.mark.in_process_mesh
def test_two_unnamed_weights_and_an_adapted_normalization_are_carried_over(devices):
    """A layer with two unnamed weights failed the build's pairing check (one unnamed weight
    per layer was mapped); an adapted Normalization's mean and variance, derived from its
    weights when the clone was built, stayed at 0 and 1 (the clone's initial values)."""
    par, model, _ = _build(devices, "tests.user_models:adapted_unnamed_convnet", "digits")
    norm = model.get_layer("normalize")
    assert abs(par.to_numpy(norm.adapt_mean)[0] - 6.5) < 1e-6
    assert abs(float(np.asarray(dtensor.unpack(norm.mean)[0]).ravel()[0]) - 6.5) < 1e-6
    assert [par.local_shape(w) for w in model.get_layer("affine").weights] == [[1], [1]]
    assert par.local_shape(model.get_layer("conv").kernel)[-1] == 2


@pytest.mark.in_process_mesh
def test_filter_split_alexnet_on_4_devices_needs_at_most_27_percent(devices):
    par, model, optimizer = _build(devices, "alexnet", "synthetic")
    split = bytes_per_device(par.plan, 32)
    unsplit = make_plan(build_model("alexnet", (224, 224, 3), 1000), "", [], {"batch": 1, "model": 1})
    full = bytes_per_device(unsplit, 32)
    ratio = (split["parameters"] + split["optimizer_slots"]) / (full["parameters"] + full["optimizer_slots"])
    assert ratio <= 0.27, ratio
    assert split["total"] < full["total"] / 2   # activations are not: gathered inputs, replicated FC inputs


ALEXNET_CONV_PARAMS = (11 * 11 * 3 * 96 + 96) + (5 * 5 * 96 * 256 + 256) + (3 * 3 * 256 * 384 + 384) + (
    3 * 3 * 384 * 384 + 384) + (3 * 3 * 384 * 256 + 256)


@pytest.mark.in_process_mesh
def test_conv_data_fc_model_is_data_parallel_convs_and_model_parallel_dense(devices):
    """Krizhevsky's trick on 1x4, global batch 32: conv kernels whole on every device, dense
    kernels split on units; device d gets image rows [8d, 8d+8) and every device the whole
    batch's labels; each device keeps a quarter of every activation (the convs' rows, the
    dense layers' units); the least traffic is the conv gradients' all-reduce over 4 and the
    batch all-gather before fc6 (with its reduce-scatter backward)."""
    par, model, optimizer = _build(devices, "alexnet", "synthetic", layout="conv_data_fc_model")
    for v in model.trainable_weights:
        local = par.local_shape(v)
        if "conv" in v.path:
            assert local == list(v.shape), v.path
        else:   # fc6, fc7, logits (1000 classes divide by 4): split on units
            assert local[-1] * 4 == v.shape[-1], v.path
    rows = tf.data.Dataset.range(32).map(lambda i: (tf.fill([2, 2, 1], tf.cast(i, tf.float32)), tf.cast(i, tf.int32)))
    images, labels = next(iter(par.distribute(lambda b: rows.batch(b))))
    for d, shard in enumerate(dtensor.unpack(images)):
        np.testing.assert_array_equal(shard.numpy()[:, 0, 0, 0], np.arange(8 * d, 8 * d + 8))
    for whole in dtensor.unpack(labels):
        np.testing.assert_array_equal(whole.numpy(), np.arange(32))

    for layer in par.plan.layers:   # every conv activation: a quarter of the rows per device
        if layer.node.cls.__name__ in ("Conv2D", "MaxPooling2D"):
            assert saved_elems(par.plan)[layer.name] * 4 == layer.node.out_elems, layer.name
    minimum = minimum_bytes(par.plan, 32)
    assert minimum["gradients"] == 2 * 3 / 4 * ALEXNET_CONV_PARAMS * 4
    gathered = 32 * (9216 + 4096 + 4096) * 4   # fc6's input (the batch), fc7's and logits' (the units)
    logits = 32 * 1000 * 4   # the split logits, gathered (forward only) for the accuracy
    assert minimum["forward_activation_payload"] == gathered + logits
    assert minimum["activations"] == pytest.approx(2 * 3 / 4 * gathered + 3 / 4 * logits)


def test_layout_rules_are_checked():
    plain = build_model("small_convnet", (8, 8, 1), 10)
    shapes = {v.path: tuple(v.shape) for v in plain.weights}
    rules = policy_rules(model_graph(plain), "filter_split", plain.name)
    specs = assign_specs(shapes, rules, {"batch": 1, "model": 4})
    assert specs["small_convnet/conv1/kernel"] == ["-", "-", "-", "model"]
    assert specs["small_convnet/logits/kernel"] == ["-", "-"]          # 10 classes do not split 4 ways
    with pytest.raises(UsageError, match="match no variable"):
        assign_specs(shapes, parse_rules(".*conv9/kernel=-,-,-,model"), {"batch": 1, "model": 2})
    with pytest.raises(UsageError, match=r"dimension 3 \(32\) does not divide by the 3 devices"):
        assign_specs(shapes, parse_rules(".*conv1/kernel=-,-,-,model"), {"batch": 1, "model": 3})
    with pytest.raises(UsageError, match="one entry per dimension"):
        assign_specs(shapes, parse_rules(".*fc1/kernel=model"), {"batch": 1, "model": 2})
    with pytest.raises(UsageError, match="is not REGEX=SPEC"):
        parse_rules("conv1")


def test_gather_lowering_is_chosen_by_the_mesh_and_the_user_wins(monkeypatch):
    """CollectiveGatherV2 on a model-only mesh, DTensor's default on a mesh with a batch axis
    (where TF 2.21's CollectiveGatherV2 is wrong), and a value the user exported is kept."""
    from tf_multigpu.parallel import dtensor_mesh
    name = dtensor_mesh.GATHER_LOWERING
    monkeypatch.setattr(dtensor_mesh, "_USER_GATHER_LOWERING", None)
    dtensor_mesh._choose_gather_lowering({"batch": 1, "model": 4})
    assert os.environ.get(name) == "1"
    dtensor_mesh._choose_gather_lowering({"batch": 2, "model": 2})
    assert name not in os.environ
    monkeypatch.setattr(dtensor_mesh, "_USER_GATHER_LOWERING", "0")
    monkeypatch.setenv(name, "0")
    dtensor_mesh._choose_gather_lowering({"batch": 1, "model": 2})
    assert os.environ[name] == "0"
    # A command started from a process that chose for its mesh does not take that for the user's.
    seen = run_code("from tf_multigpu.parallel import dtensor_mesh as m; print(m._USER_GATHER_LOWERING)",
                    env={name: "1", dtensor_mesh._OURS: "1"}, timeout=120)
    assert seen.stdout.strip().splitlines()[-1] == "None", seen.stderr[-2000:]


@pytest.mark.parametrize("flags, needle", [
    (["--strategy=hybrid", "--cpu_devices=4", "--mesh=batch:4,model:1"], "--strategy=hybrid needs both mesh axes > 1"),
    (["--strategy=model", "--cpu_devices=2", "--mesh=batch:2,model:2"],
     "needs 4 devices but 2 are used: make B*M = 2, or use 4 devices (--cpu_devices=4)"),
    (["--strategy=model", "--mesh=model:two"], "is not batch:B,model:M"),
    (["--strategy=model", "--layout=pipeline"], "unknown --layout='pipeline': choose one of filter_split, fc_only"),
    (["--strategy=model", "--layout_rules=.*conv9/kernel=-,-,-,model"], "match no variable"),
    (["--strategy=model", "--cpu_devices=3", "--batch_size=63"],
     "--layout=filter_split can split none of small_convnet's layers over the 3 devices of mesh axis 'model'"),
    (["--strategy=data", "--mesh=batch:2,model:1"], "--mesh applies to --strategy=model or hybrid"),
    (["--strategy=model", "--cpu_devices=3", "--batch_size=63"],   # all named at once; keeping all whole is no fix
     "(conv1/kernel dimension 3 (32); conv2/kernel dimension 3 (64); conv3/kernel dimension 3 (128); "
     "fc1/kernel dimension 1 (256)): change --mesh or the layout"),
    (["--strategy=model", "--layout_overrides=.*conv9/kernel=-,-,-,-"],
     "--layout_overrides rule(s) ['.*conv9/kernel'] match no variable"),
    (["--strategy=model", "--layout_overrides=.*conv1/kernel"], "--layout_overrides item '.*conv1/kernel' is not"),
    (["--strategy=model", "--layout_rules=.*conv1/kernel=-,-,-,model", "--layout_overrides=.*conv2/kernel=-,-,-,-"],
     "--layout_rules replaces --layout's rules and --layout_overrides amends them: give one"),
    (["--strategy=data", "--layout_overrides=.*conv1/kernel=-,-,-,-"],
     "--layout_overrides applies to --strategy=model, hybrid or auto (its model and hybrid plans), not data"),
])
def test_bad_meshes_and_layouts_exit_2(tmp_path, flags, needle):
    done = run_cli(f"--run_dir={tmp_path / 'run'}", *flags)
    assert done.returncode == 2, done.stderr[-2000:]
    assert needle in done.stderr.strip().splitlines()[-1], done.stderr[-1000:]
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_checkpoint_from_2x2_resumes_on_1x4_and_on_one_device(tmp_path):
    # The default run, dropout included: its masks do not depend on the mesh (StatelessDropout).
    common = ["--steps=8", "--checkpoint_every=4", "--batch_size=32", "--seed=2", "--noexport"]
    whole = str(tmp_path / "whole")
    assert run_cli(f"--run_dir={whole}", "--strategy=hybrid", "--cpu_devices=4", *common).returncode == 0
    for name, flags in [("mesh1x4", ["--strategy=model", "--cpu_devices=4"]), ("single", ["--strategy=single"])]:
        resumed = str(tmp_path / name)
        shutil.copytree(whole, resumed)
        keep_only_checkpoint(resumed, 4)
        done = run_cli(f"--run_dir={resumed}", *flags, *common)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "steps 4..8" in done.stdout
        a, b = checkpoint_values(whole), checkpoint_values(resumed)
        weights = [k for k in a if "/kernel" in k or "_trainable" in k]
        # Other meshes sum in other orders: equal to fp32 rounding, not bitwise. And rounding can
        # put a value on the other side of a ReLU's or a max-pool's decision: with seed 2, one
        # device's own 8 steps from scratch end 2.2e-5 from the hybrid's and data x4's (1.5e-8
        # at step 4, 4.7e-6 at step 6; data x4 and hybrid agree to 3e-8; so do one device and
        # the hybrid with seeds 3 and 4), with oneDNN's kernels and Eigen's. atol stays 30-180 times below
        # what each variable moves in the four resumed steps (3.3e-3 to 1.8e-2).
        for key in weights:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-4, err_msg=f"{name} {key}")


@pytest.mark.slow
def test_hybrid_learns_digits_like_data_parallel(tmp_path, default_run):
    # Data parallelism: the default command (conftest.py), the same run on 2 devices instead of
    # 4. Its step is one device's on any number of devices (test_parity.py), so its accuracy
    # is the data-parallel accuracy of these settings.
    results = {"data": default_run[2]}
    assert results["data"]["strategy"] == "data"
    done = run_cli(f"--run_dir={tmp_path / 'hybrid'}", "--strategy=hybrid", "--cpu_devices=4", timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    results["hybrid"] = json.loads(done.stdout.strip().splitlines()[-1])
    assert results["hybrid"]["test_accuracy"] >= results["data"]["test_accuracy"] - 0.01
    assert results["hybrid"]["test_accuracy"] >= 0.97
    # The export (a plain one-device model from the mesh's values) predicts what the trained
    # mesh model measured, and equals an export of the same checkpoint made on one device.
    run_dir = str(tmp_path / "hybrid")
    again = run_module("tf_multigpu.export_main", f"--run_dir={run_dir}",
                       f"--export_dir={tmp_path / 'one_device_export'}", timeout=200)
    assert again.returncode == 0, again.stderr[-2000:]
    served = serve_digits([os.path.join(run_dir, "export"), str(tmp_path / "one_device_export")])
    assert abs(served[0]["accuracy"] - results["hybrid"]["test_accuracy"]) < 1e-9
    np.testing.assert_allclose(served[0]["probabilities"], served[1]["probabilities"], atol=1e-6)



@pytest.mark.slow
def test_conv_data_fc_model_trains_like_data_parallelism(tmp_path):
    """From the command line, 12 steps and an evaluation on 4 devices: the same weights and
    test loss as data parallelism (same batches, same update; sums in another order)."""
    common = ["--cpu_devices=4", "--steps=12", "--log_every=4", "--batch_size=32", "--learning_rate=0.2",
              "--lr_schedule=constant", "--noexport"]
    results = {}
    for name, flags in [("data", ["--strategy=data"]),
                        ("trick", ["--strategy=model", "--layout=conv_data_fc_model"])]:
        done = run_cli(f"--run_dir={tmp_path / name}", *flags, *common)
        assert done.returncode == 0, done.stderr[-2000:]
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    assert results["trick"]["strategy"] == "model"
    assert results["trick"]["test_loss"] == pytest.approx(results["data"]["test_loss"], rel=1e-4)
    assert results["trick"]["test_loss"] < 2.1   # it learned: the initial loss is ln(10) = 2.30
    a, b = checkpoint_values(tmp_path / "data"), checkpoint_values(tmp_path / "trick")
    for key in (k for k in a if "/kernel" in k):
        np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_model_parallel_export_predicts_what_the_mesh_model_measured(tmp_path):
    run_dir = str(tmp_path / "model")
    done = run_cli(f"--run_dir={run_dir}", "--strategy=model", "--cpu_devices=2", "--steps=40")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    served = serve_digits([os.path.join(run_dir, "export")])
    assert abs(served[0]["accuracy"] - summary["test_accuracy"]) < 1e-9
    assert summary["test_accuracy"] > 0.5


@pytest.mark.slow
def test_mobilenet_v2_export_from_hybrid_equals_the_one_device_export(tmp_path):
    """keras.applications' MobileNetV2 (BatchNorm, depthwise convolutions, zero padding, residual
    adds; cut after its first blocks, placed layer for layer as the whole model and with every
    kind of its placements: test_placement.py) trained 2 steps on a 2x2 mesh:
    the run's export and the export of the same checkpoint made afterwards on one device
    serve the same probabilities. (A fresh process that knows only TensorFlow serves exports
    in test_export.py; here this process loads both.)"""
    run_dir = str(tmp_path / "mobilenet")
    done = run_cli(f"--run_dir={run_dir}", "--strategy=hybrid", "--cpu_devices=4", "--dataset=synthetic",
                   "--image_size=32", "--model=tests.user_models:mobilenet_v2_first_blocks", "--batch_size=8",
                   "--steps=2", "--learning_rate=0.01", "--log_every=2", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    again = run_module("tf_multigpu.export_main", f"--run_dir={run_dir}", f"--export_dir={tmp_path / 'one_device'}",
                       "--noevaluate", timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    images = tf.constant(np.random.RandomState(0).randint(0, 256, (6, 32, 32, 3)).astype(np.uint8))
    a, b = (tf.saved_model.load(path).signatures["serving_default"](images=images)["probabilities"].numpy()
            for path in (os.path.join(run_dir, "export"), str(tmp_path / "one_device")))
    difference, scale = float(np.abs(a - b).max()), float(np.abs(a).max())
    assert scale > 0 and difference <= 1e-6, (difference, scale)


_EARLIER_MESH_WORKER = textwrap.dedent("""
    import tensorflow as tf
    from tensorflow.experimental import dtensor
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    # a 1x2 mesh used first: DTensor's default mesh for ops that name none, for good
    mesh = dtensor.create_mesh([("batch", 1), ("model", 2)], devices=["CPU:0", "CPU:1"])
    dtensor.copy_to_mesh(tf.ones(()), dtensor.Layout.replicated(mesh, 0))
    from tf_multigpu.config import Config
    from tf_multigpu.training.run import build_run
    run = build_run(Config(strategy="model", model="alexnet", dataset="synthetic", batch_size=32,
                           steps=10, mesh="batch:1,model:4", layout="filter_split"),
                    [f"/device:CPU:{i}" for i in range(4)])
    slots = [v for v in run.optimizer.variables if len(v.shape) == 4]
    print(len(slots), {run.par.local_shape(v)[-1] * 4 == v.shape[-1] for v in slots})
""")


@pytest.mark.slow
def test_a_mesh_built_after_another_one_gets_its_slots():
    """Keras makes the momentum slots' zeros on the DTensor device, which puts an op naming no
    mesh on the first mesh the process used; copying them from a 1x2 mesh to a 1x4 one hung
    (in assign_variable_op). The creator makes them on the run's own mesh."""
    done = run_code(_EARLIER_MESH_WORKER, timeout=120, fresh=True)   # passes in ~8 s
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "5 {True}", done.stdout[-500:]
