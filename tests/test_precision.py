"""--dtype (Keras mixed precision, loss scaling for float16) and --xla for every strategy:
the step still equals one device's, within a tolerance that fits the precision, and training
reaches the float32 accuracy."""

import json
import os

import pytest
import tensorflow as tf

from tests.conftest import run_cli
from tests.helpers import max_update_difference, one_step
from tests.test_parity import TOLERANCE as FLOAT32_TOLERANCE
from tests.test_parity import parity_result

# Mixed precision computes in 16 bits; weights, gradients' all-reduce and updates are float32.
# bfloat16 keeps 8 significant bits (one rounding ~0.4%). A replica sums the per-example
# weight-gradient products of ITS rows in bfloat16, so N replicas round other partial sums
# than one device does, and the filter-split convolution (im2col + einsum) rounds in other
# places than oneDNN's convolution. Measured (max over variables of |dUpdate| / max|update|,
# one step, lr=1): data 2 and 4 devices 0.030, model 1x2 0.064, hybrid 2x2 0.058. 0.1 fits that
# and still fails for a wrong loss scale or a missed all-reduce (>= 0.5). float16 keeps 11
# bits: measured 6.8e-4 (data) and 8.7e-4 (model) on an earlier machine, 1.6e-3 and 3.0e-3 on an
# AMD EPYC (split convolutions accumulate float16 in float32, split_conv.py); 5e-3.
TOLERANCE = {"bfloat16": 0.1, "float16": 5e-3}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_data_parallel_step_equals_one_device(dtype, digits_batch, devices):
    source, images, labels = digits_batch
    before, single = one_step("single", devices, source, images, labels, dtype=dtype)
    _, parallel = one_step("data", devices[:2], source, images, labels, dtype=dtype)
    assert max_update_difference(before, parallel, single) < TOLERANCE[dtype]


# float16 on CPU is emulated (~100x slower than bfloat16), so it is checked on the smallest
# mesh; its loss-scaling path is the same code for every strategy.
def test_xla_really_compiles_the_step(digits_batch, devices):
    """--xla is not dropped on the way: an op XLA cannot compile (a host Python function)
    trains without it and fails the step with it."""
    source, images, labels = digits_batch
    model = "tests.user_models:host_op_convnet"
    one_step("data", devices[:2], source, images, labels, model=model)
    with pytest.raises(tf.errors.OpError, match="(?i)xla|unsupported|compil"):
        one_step("data", devices[:2], source, images, labels, model=model, xla=True)


@pytest.mark.xdist_group("parity_worker")   # test_parity.parity_result's shared workers
@pytest.mark.parametrize("strategy, mesh, dtype", [
    ("model", "batch:1,model:2", "bfloat16"), ("hybrid", "batch:2,model:2", "bfloat16"),
    ("model", "batch:1,model:2", "float16")])
def test_mixed_precision_model_and_hybrid_step_equals_one_device(strategy, mesh, dtype):
    result = parity_result(strategy, mesh, "filter_split", 1, f"dtype={dtype}")["filter_split"]
    assert result["same_initial_weights"]
    assert result["max_update_difference"] < TOLERANCE[dtype], result


def test_mixed_precision_is_applied_and_weights_stay_float32(digits_batch, devices):
    """The policy really changes the compute (the update is not float32's), not the weights."""
    source, images, labels = digits_batch
    before, fp32 = one_step("single", devices, source, images, labels)
    _, bf16 = one_step("single", devices, source, images, labels, dtype="bfloat16")
    assert all(w.dtype.name == "float32" for w in bf16)
    assert 1e-3 < max_update_difference(before, bf16, fp32) < TOLERANCE["bfloat16"]


def test_xla_data_parallel_step_equals_one_device(digits_batch, devices):
    source, images, labels = digits_batch
    before, single = one_step("single", devices, source, images, labels)
    _, parallel = one_step("data", devices[:2], source, images, labels, xla=True)
    # XLA fuses and reorders float32 arithmetic: ulp-level differences, as in test_parity.py.
    assert max_update_difference(before, parallel, single) <= FLOAT32_TOLERANCE


@pytest.mark.xdist_group("parity_worker")   # test_parity.parity_result's shared workers
@pytest.mark.parametrize("strategy, mesh", [("model", "batch:1,model:2"), ("hybrid", "batch:2,model:2")])
def test_xla_model_and_hybrid_step_equals_one_device(strategy, mesh):
    result = parity_result(strategy, mesh, "filter_split", 1, "xla=1")["filter_split"]
    assert result["max_update_difference"] <= FLOAT32_TOLERANCE, result


@pytest.mark.slow
def test_bfloat16_and_xla_train_digits_to_the_float32_accuracy(tmp_path, default_run):
    # float32: the default command (conftest.py), which is these runs without --dtype/--xla.
    run_dir, _, summary = default_run
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert (config["dtype"], config["xla"], summary["strategy"], len(summary["devices"])) == (
        "float32", False, "data", 2)
    accuracy = {"float32": summary["test_accuracy"]}
    for name, flags in [("bfloat16", ["--dtype=bfloat16"]), ("xla", ["--xla"])]:
        done = run_cli(f"--run_dir={tmp_path / name}", "--cpu_devices=2", *flags, "--noexport", timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        accuracy[name] = json.loads(done.stdout.strip().splitlines()[-1])["test_accuracy"]
    assert accuracy["float32"] >= 0.97, accuracy
    for name in ("bfloat16", "xla"):
        assert abs(accuracy[name] - accuracy["float32"]) <= 0.01, accuracy


def test_a_softmax_head_trains_on_its_logits_in_mixed_precision(digits_batch, devices):
    """A model with probabilities out (keras.applications' default head) is trained on the
    logits before its softmax. Under mixed precision the loss reads the float32 cast of the
    output, behind which Keras' loss no longer finds the logits: it took the probabilities for
    logits, and the bfloat16 update shrank: its norm was 0.08 of the float32 one (now 1.007
    with oneDNN's kernels, 0.999 with Eigen's). The norms are compared, not max_update_difference:
    with Eigen's bfloat16 kernels this small model's conv2 bias is 0.32 from float32's (0.04
    with oneDNN), over the tolerance above, for a right step."""
    import numpy as np
    source, images, labels = digits_batch
    model = "tests.user_models:softmax_head_convnet"
    before, fp32 = one_step("single", devices, source, images, labels, model=model)
    _, bf16 = one_step("single", devices, source, images, labels, model=model, dtype="bfloat16")

    def size(after):   # the whole update's Euclidean norm
        return np.sqrt(sum(float(np.sum((a - w) ** 2)) for a, w in zip(after, before)))
    assert 0.8 < size(bf16) / size(fp32) < 1.25, size(bf16) / size(fp32)
