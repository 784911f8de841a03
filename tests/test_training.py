"""The loop: outputs, exact resume, resuming on another strategy, checkpoint refusal, and the
learning-rate schedules it trains with."""

import dataclasses
import glob
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import checkpoint_values, keep_only_checkpoint
from tf_multigpu.config import Config
from tf_multigpu.errors import UsageError
from tf_multigpu.training.loop import train
from tf_multigpu.training.optimizer import learning_rate_schedule


@pytest.fixture
def cfg(tmp_path):
    return Config(run_dir=str(tmp_path / "run"), steps=8, checkpoint_every=4, log_every=2,
                  eval_every=4, seed=1, batch_size=32)


def test_outputs(cfg, devices):
    summary = train(cfg, devices[:2])
    root = cfg.run_dir
    assert summary["step"] == 8 and summary["strategy"] == "data" and len(summary["devices"]) == 2
    assert json.load(open(os.path.join(root, "summary.json")))["test_accuracy"] == summary["test_accuracy"]
    assert json.load(open(os.path.join(root, "config.json")))["batch_size"] == 32
    assert tf.train.latest_checkpoint(os.path.join(root, "checkpoints")).endswith("ckpt-8")
    assert glob.glob(os.path.join(root, "tensorboard", "events.out.tfevents.*"))
    assert os.path.exists(os.path.join(root, "export", "saved_model.pb"))
    tags = set()
    for event_file in glob.glob(os.path.join(root, "tensorboard", "events.*")):
        for event in tf.compat.v1.train.summary_iterator(event_file):
            tags |= {v.tag for v in event.summary.value}
    assert {"train/loss", "train/accuracy", "train/learning_rate", "train/examples_per_sec",
            "train/step_time_s", "test/test_loss", "test/test_accuracy"} <= tags


def test_resume_ends_with_the_weights_of_an_uninterrupted_run(cfg, tmp_path, devices, capsys):
    train(cfg, devices[:2])
    whole = checkpoint_values(cfg.run_dir)
    resumed_dir = str(tmp_path / "resumed")
    shutil.copytree(cfg.run_dir, resumed_dir)
    keep_only_checkpoint(resumed_dir, 4)
    capsys.readouterr()
    summary = train(dataclasses.replace(cfg, run_dir=resumed_dir), devices[:2])
    assert "steps 4..8" in capsys.readouterr().out
    resumed = checkpoint_values(resumed_dir)
    assert summary["step"] == 8 and whole.keys() == resumed.keys()
    for name in whole:   # model, optimizer slots, iteration count, dropout RNG state
        np.testing.assert_array_equal(whole[name], resumed[name], err_msg=name)


def test_a_finished_run_run_again_keeps_its_training_measurements(cfg, devices):
    """It trains no step, so it measures none: summary.json's loss and throughput were
    rewritten as null (a profiled run's communication dropped)."""
    first = train(cfg, devices[:2])
    again = train(cfg, devices[:2])
    for key in ("loss", "accuracy", "examples_per_sec", "step_time_s"):
        assert again[key] == first[key] is not None, key
    assert json.load(open(os.path.join(cfg.run_dir, "summary.json")))["loss"] == first["loss"]
    assert again["test_accuracy"] == first["test_accuracy"]   # evaluated again, on the same weights
    other = train(dataclasses.replace(cfg, strategy="single"), devices[:1])   # others measured nothing of its own
    assert other["strategy"] == "single" and other["loss"] is None and other["examples_per_sec"] is None


def test_checkpoint_from_data_parallel_resumes_on_one_device(cfg, tmp_path, devices, capsys):
    train(cfg, devices[:4])
    whole = checkpoint_values(cfg.run_dir)
    keep_only_checkpoint(cfg.run_dir, 4)
    capsys.readouterr()
    train(dataclasses.replace(cfg, strategy="single"), devices[:1])
    # Training is deterministic, so a run that ignored ckpt-4 and started again would end
    # with the same weights: that it resumed is shown by the steps it ran.
    assert "steps 4..8" in capsys.readouterr().out
    single = checkpoint_values(cfg.run_dir)
    for name in whole:
        if "kernel" in name and "OPTIMIZER_SLOT" not in name:
            np.testing.assert_allclose(single[name], whole[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_corrupt_checkpoint_is_refused_and_kept(cfg, devices, capsys):
    train(cfg, devices[:2])   # ckpt-4, ckpt-8
    data_file = glob.glob(os.path.join(cfg.run_dir, "checkpoints", "ckpt-8.data-*"))[0]
    with open(data_file, "r+b") as f:
        f.truncate(100)
    with pytest.raises(UsageError, match=r"ckpt-8 cannot be restored .*: move its files \(ckpt-8\.\*\) out of "
                                         r".* to resume from ckpt-4, or use a new"):
        train(dataclasses.replace(cfg, steps=12), devices[:2])
    assert os.path.getsize(data_file) == 100   # left for the user to inspect, not deleted
    # Its files moved out, as the message says: the run resumes from the one before.
    moved = os.path.join(os.path.dirname(cfg.run_dir), "moved")
    os.makedirs(moved)
    for f in glob.glob(os.path.join(cfg.run_dir, "checkpoints", "ckpt-8.*")):
        shutil.move(f, moved)
    capsys.readouterr()
    train(dataclasses.replace(cfg, steps=12), devices[:2])
    assert "steps 4..12" in capsys.readouterr().out


def test_the_only_checkpoint_corrupt_is_refused_naming_a_new_run_dir(cfg, devices):
    train(dataclasses.replace(cfg, steps=4), devices[:2])
    data_file = glob.glob(os.path.join(cfg.run_dir, "checkpoints", "ckpt-4.data-*"))[0]
    with open(data_file, "r+b") as f:
        f.truncate(100)
    with pytest.raises(UsageError, match="ckpt-4 cannot be restored .*: it is the run's only checkpoint: use a new"):
        train(cfg, devices[:2])
    # Its files and the state file moved out, as the message says: training starts again.
    for f in glob.glob(os.path.join(cfg.run_dir, "checkpoints", "*")):
        os.remove(f)
    assert train(cfg, devices[:2])["step"] == 8


def _ckpt_files(run_dir):
    files = glob.glob(os.path.join(run_dir, "checkpoints", "ckpt-*"))
    return {os.path.basename(f): open(f, "rb").read() for f in files}


@pytest.mark.parametrize("damage", ["missing", "garbled", "names_a_moved_checkpoint"])
def test_a_damaged_checkpoint_state_resumes_from_the_newest_checkpoint_on_disk(cfg, devices, capsys, caplog, damage):
    """The state file (checkpoints/checkpoint) lost, garbled, or naming a checkpoint moved away:
    the run went on from the checkpoint on disk, not from step 0 over the old checkpoints."""
    train(cfg, devices[:2])   # ckpt-4, ckpt-8
    state = os.path.join(cfg.run_dir, "checkpoints", "checkpoint")
    if damage == "missing":
        os.remove(state)
    elif damage == "garbled":
        open(state, "w").write("garbage !!! {{\n")
    else:
        for f in glob.glob(os.path.join(cfg.run_dir, "checkpoints", "ckpt-8.*")):
            os.remove(f)
    kept = _ckpt_files(cfg.run_dir)
    resumed_at = 4 if damage == "names_a_moved_checkpoint" else 8
    state_before = open(state).read() if os.path.exists(state) else None
    with pytest.raises(UsageError, match="past the end of --steps"):   # refused: writes nothing, state file included
        train(dataclasses.replace(cfg, steps=resumed_at - 2), devices[:2])
    assert (open(state).read() if os.path.exists(state) else None) == state_before
    # The state file names the checkpoints on disk again, even where the run saves nothing
    # (an export then names its checkpoint), so the manager deletes them in turn as it saves.
    caplog.clear()
    train(dataclasses.replace(cfg, steps=resumed_at), devices[:2])
    assert f"resuming from ckpt-{resumed_at}" in caplog.text
    assert tf.train.latest_checkpoint(os.path.join(cfg.run_dir, "checkpoints")).endswith(f"ckpt-{resumed_at}")
    capsys.readouterr()
    caplog.clear()
    train(dataclasses.replace(cfg, steps=12), devices[:2])
    assert f"steps {resumed_at}..12" in capsys.readouterr().out
    assert "resuming from" not in caplog.text   # the state file names its checkpoint again
    after = _ckpt_files(cfg.run_dir)
    assert all(after.get(name) == data for name, data in kept.items() if name.startswith("ckpt-4."))
    state = tf.train.get_checkpoint_state(os.path.join(cfg.run_dir, "checkpoints"))
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == ["ckpt-4", "ckpt-8", "ckpt-12"]


def test_an_empty_checkpoint_state_is_one_line(cfg, devices):
    train(dataclasses.replace(cfg, steps=4), devices[:2])
    open(os.path.join(cfg.run_dir, "checkpoints", "checkpoint"), "w").close()   # after a power cut
    with pytest.raises(UsageError, match="checkpoint is empty or invalid .*: delete it, and the run resumes"):
        train(cfg, devices[:2])


def test_a_checkpoint_of_another_model_is_not_called_damaged(cfg, devices, monkeypatch):
    """A user's --model module edited under the same name: no checkpoint of the run fits, so
    "move it out to resume from the one before" would strip the run one checkpoint at a time."""
    import keras

    import tests.user_models
    cfg = dataclasses.replace(cfg, model="tests.user_models:unnamed_dropout_convnet")
    train(cfg, devices[:2])

    def edited(input_shape, num_classes, **_):
        return keras.Sequential([keras.Input(input_shape), keras.layers.Conv2D(8, 3, name="conv1"),
                                 keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(num_classes)])
    monkeypatch.setattr(tests.user_models, "unnamed_dropout_convnet", edited)
    with pytest.raises(UsageError, match="ckpt-8 does not fit this run's model .*: its --model's code changed"):
        train(dataclasses.replace(cfg, steps=12), devices[:2])


def test_a_file_system_without_locks_trains_unlocked_with_a_warning(cfg, devices, monkeypatch, caplog):
    import errno
    import fcntl

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert train(dataclasses.replace(cfg, steps=0), devices[:2])["step"] == 0
    assert "cannot lock" in caplog.text and "No locks available" in caplog.text


def test_a_state_naming_checkpoints_that_are_all_gone_is_refused(cfg, devices):
    train(dataclasses.replace(cfg, steps=4), devices[:2])
    for f in glob.glob(os.path.join(cfg.run_dir, "checkpoints", "ckpt-*")):
        os.remove(f)
    with pytest.raises(UsageError, match="names ckpt-4, but no checkpoint's files are in .*: put them back"):
        train(cfg, devices[:2])


def test_fewer_steps_than_the_checkpoint_has_done_are_refused_before_any_write(cfg, devices):
    train(cfg, devices[:2])
    written = {name: open(os.path.join(cfg.run_dir, name)).read() for name in ("config.json", "summary.json")}
    with pytest.raises(UsageError, match="is at step 8, past the end of --steps=4: pass --steps=8 or more"):
        train(dataclasses.replace(cfg, steps=4), devices[:2])
    assert written == {name: open(os.path.join(cfg.run_dir, name)).read() for name in written}


def test_a_schedule_whose_span_changes_on_resume_is_warned_of(cfg, devices, caplog):
    train(dataclasses.replace(cfg, steps=4), devices[:2])
    train(cfg, devices[:2])   # cosine, the default: steps 1-4 decayed towards 0 at step 4
    assert "the cosine learning-rate schedule now spans 8 steps instead of 4" in caplog.text
    caplog.clear()
    constant = dataclasses.replace(cfg, run_dir=cfg.run_dir + "_constant", lr_schedule="constant")
    train(dataclasses.replace(constant, steps=4), devices[:2])
    train(constant, devices[:2])
    assert "schedule now spans" not in caplog.text


def test_a_run_directory_in_use_is_refused(cfg, devices):
    from tf_multigpu.training.run_dir import writing_alone
    with writing_alone(cfg.run_dir):
        with pytest.raises(UsageError, match=f"is being trained by another process \\(pid {os.getpid()}\\)"):
            train(cfg, devices[:2])
        assert not os.path.exists(os.path.join(cfg.run_dir, "config.json"))
    train(dataclasses.replace(cfg, steps=0), devices[:2])   # free again
    assert not os.path.exists(os.path.join(cfg.run_dir, ".training.lock"))


def test_an_export_directory_holding_other_files_is_refused_before_training(cfg, devices):
    os.makedirs(os.path.join(cfg.run_dir, "export"))
    open(os.path.join(cfg.run_dir, "export", "notes.txt"), "w").write("mine")
    with pytest.raises(UsageError, match="holds files that are not a SavedModel"):
        train(cfg, devices[:2])
    assert not os.path.exists(os.path.join(cfg.run_dir, "checkpoints"))


def test_a_run_directory_that_cannot_be_written_is_one_line(cfg, devices, monkeypatch):
    from tf_multigpu.training.workers import WorkerRole

    def read_only(*_):
        raise OSError(30, "Read-only file system", cfg.run_dir + "/config.json")
    monkeypatch.setattr(WorkerRole, "write_config", read_only)
    with pytest.raises(UsageError, match=r"cannot write to --run_dir=.*Read-only file system.*: choose a writable"):
        train(cfg, devices[:2])


def test_a_checkpoint_that_cannot_be_saved_is_one_line_and_leaves_no_partial_one(cfg, devices, monkeypatch):
    """A full disk fails TensorFlow's SaveV2 with ResourceExhaustedError, which had been
    reported as out of device memory."""
    def full_disk(manager, checkpoint_number):
        os.makedirs(os.path.join(manager.directory, f"ckpt-{checkpoint_number}_temp"))
        raise tf.errors.ResourceExhaustedError(None, None, "ckpt-4_temp/part-00000-of-00001.data.tempstate; "
                                                           "No space left on device")
    monkeypatch.setattr(tf.train.CheckpointManager, "save", full_disk)
    with pytest.raises(UsageError, match="cannot save checkpoint 4 in .* \\(.*No space left on device\\): free space"):
        train(cfg, devices[:2])
    assert not glob.glob(os.path.join(cfg.run_dir, "checkpoints", "ckpt-4_temp*"))


def test_steps_zero_exports_the_initial_model(cfg, devices):
    summary = train(dataclasses.replace(cfg, steps=0), devices[:2])
    assert summary["step"] == 0
    assert 0.0 <= summary["test_accuracy"] < 0.5      # untrained
    assert os.path.exists(os.path.join(cfg.run_dir, "export", "saved_model.pb"))


@pytest.mark.parametrize("named", [True, False])
def test_a_window_of_steps_traces_a_named_step_once(devices, named):
    """The compiled window sums N steps' scalars. A step that names its scalars (every step of
    training/step.py) is traced once, inside the loop; an unnamed one twice (the first step
    outside it gives the totals' structure). Tracing a large model costs as much as a step."""
    from tf_multigpu.parallel import make_parallelism
    from tf_multigpu.training.step import SCALARS

    traces = []

    def step(x):
        traces.append(1)
        return {"loss_sum": tf.reduce_sum(x), "correct": tf.reduce_sum(x) * 2, "count": tf.ones([])}

    if named:
        step.scalars = SCALARS
    par = make_parallelism("data", devices[:2], 4)
    run = par.compile(step)
    batches = iter(par.distribute(lambda b: tf.data.Dataset.range(100).map(lambda i: (tf.cast(i, tf.float32),))
                                  .batch(b)))
    totals = {k: float(v) for k, v in run(batches, tf.constant(3)).items()}
    assert totals == {"loss_sum": 66.0, "correct": 132.0, "count": 6.0}   # rows 0..11, 2 replicas x 3 steps
    assert len(traces) == (1 if named else 2) * 2   # strategy.run traces the step once per replica


def test_plain_sgd_decays_kernels_inside_the_gradient():
    """momentum=0: w <- w - lr * (g + wd * w) for kernels (rank >= 2), w <- w - lr * g for biases."""
    import keras

    from tf_multigpu.training.optimizer import MomentumSGD

    kernel, bias = keras.Variable(np.full((2, 2), 2.0, np.float32)), keras.Variable(np.full((2,), 2.0, np.float32))
    opt = MomentumSGD(0.5, momentum=0.0, l2=0.1)
    opt.apply([tf.ones((2, 2)), tf.ones((2,))], [kernel, bias])
    np.testing.assert_allclose(kernel.numpy(), 2.0 - 0.5 * (1.0 + 0.1 * 2.0))
    np.testing.assert_allclose(bias.numpy(), 2.0 - 0.5 * 1.0)


@pytest.mark.in_process_mesh
def test_no_update_temporary_exists_before_its_gradient(devices):
    """Every tensor the optimizer's update makes from a variable (the decay's l2 * w, the
    momentum's m * v) waits for the gradient: one that only reads variables would be computed
    as the step starts and held through the forward and backward pass (2 x the parameters;
    training/optimizer.py). Hybrid 2x2. (With --shard_optimizer_state the weights' slice to
    the slot's shard is still such a read: BUILD_NOTES.md, "Memory, fifth pass".)"""
    from tf_multigpu.data import load_source
    from tf_multigpu.training.run import build_run
    from tf_multigpu.training.step import make_train_step

    cfg = Config(strategy="hybrid", model="small_convnet", batch_size=64, steps=1, mesh="batch:2,model:2",
                 layout="filter_split")
    run = build_run(cfg, devices[:4], source=load_source("digits"))
    images, labels = next(iter(run.train_batches()))
    graph = tf.function(make_train_step(run.model, run.optimizer, 64)).get_concrete_function(images, labels).graph
    update = [op for op in graph.get_operations() if op.name.startswith(run.optimizer.name + "/")
              and any(t.op.type == "ReadVariableOp" for t in op.inputs) and op.outputs
              and op.outputs[0].shape.rank]   # not the learning rate's scalars

    def after_a_gradient(op):
        seen, todo = set(), [op]
        while todo:
            for producer in [t.op for t in todo.pop().inputs]:
                if producer.name.startswith("gradient"):
                    return True
                if producer.name not in seen:
                    seen.add(producer.name)
                    todo.append(producer)
        return False

    assert len(update) >= 6, [op.name for op in update]   # at least m * v and l2 * w of three kernels
    early = [f"{op.type} {op.name}" for op in update if not after_a_gradient(op)]
    assert not early, early


# rate at a step, without warm-up, for 100 steps at peak 0.1
SCHEDULES = {"constant": {0: 0.1, 50: 0.1, 99: 0.1},
             "step": {0: 0.1, 49: 0.1, 50: 0.01, 74: 0.01, 75: 0.001, 99: 0.001},   # /10 at 50% and 75%
             "cosine": {0: 0.1, 25: 0.1 * (1 + np.cos(np.pi / 4)) / 2, 50: 0.05, 100: 0.0}}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_learning_rate_schedules_and_their_warm_up(schedule):
    def rate_of(total, step, warmup=0):
        return float(learning_rate_schedule(0.1, schedule, total, warmup)(step))

    def rate(step, warmup=0):
        return rate_of(100, step, warmup)

    for step, expected in SCHEDULES[schedule].items():
        assert rate(step) == pytest.approx(expected, abs=1e-7), step
    # The same linear warm-up for every schedule: the first step already at peak / 10 (none is
    # spent at rate 0), the peak at the warm-up's last step.
    assert [rate(s, 10) for s in range(10)] == pytest.approx([0.01 * (s + 1) for s in range(10)])
    if schedule == "step":     # a short run divides after half and three quarters too, rounded up
        for total, expected in [(1, [0.1]), (2, [0.1, 0.01]), (3, [0.1, 0.1, 0.01]), (5, [0.1, 0.1, 0.1, 0.01, 0.001])]:
            assert [rate_of(total, s) for s in range(total)] == pytest.approx(expected), total
    if schedule == "cosine":   # then the decay spans the steps after the warm-up
        assert [rate(s, 10) for s in (10, 55, 100)] == pytest.approx([0.1, 0.05, 0.0], abs=1e-7)
    else:                      # then the schedule's own boundaries, in steps from the start
        assert [rate(s, 10) for s in range(10, 100)] == pytest.approx([rate(s) for s in range(10, 100)])


@pytest.mark.in_process_mesh
def test_only_the_train_step_has_while_loops(devices):
    """TensorFlow 2.21's DTensor names a while loop's outlined functions through a cache keyed
    by the loop op's address, which outlives the compilation: a second function with loops
    could get the first one's names, and its first evaluation failed ("Cannot add function
    'while_4_body' because a different function with the same name already exists"; 1 run in
    5 of MobileNetV2 on 2x2, BUILD_NOTES "Limits hit"). The split layers' tap sums loop in
    the train step and are unrolled in the eval step. Model 1x2, Xception's separable layers."""
    from tf_multigpu.data import load_source
    from tf_multigpu.training.run import build_run
    from tf_multigpu.training.step import make_eval_step, make_train_step

    cfg = Config(strategy="model", model="tests.user_models:separable_convnet", batch_size=8, steps=1,
                 mesh="model:2", layout="filter_split", dataset="synthetic", image_size=16)
    run = build_run(cfg, devices[:2], source=load_source("synthetic", image_size=16))
    images, labels = next(iter(run.train_batches()))

    def loops(step, *args):
        graph = tf.function(step).get_concrete_function(*args).graph
        return [op.name for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]

    assert len(loops(make_train_step(run.model, run.optimizer, 8), images, labels)) >= 6   # fwd and bwd
    assert loops(make_eval_step(run.model), images, labels, tf.ones_like(labels)) == []


@pytest.mark.parametrize("message, reason", [
    ("Graph execution error:\n\nDetected at node decode_image/DecodeImage defined at (most recent call last):\n"
     "<stack traces unavailable>\nInvalid PNG data, size 686\n\t [[{{node decode_image/DecodeImage}}]]",
     "Invalid PNG data, size 686"),
    ("Graph execution error:\n\n2 root error(s) found.\n  (0) INVALID_ARGUMENT:  Invalid PNG data, size 686\n"
     "\t [[{{node decode_image/DecodeImage}}]]", "Invalid PNG data, size 686"),
    ("{{function_node __wrapped__RestoreV2_dtypes_21_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
     "Checksum does not match: stored 1 vs. calculated on the restored bytes 2 [Op:RestoreV2]",
     "Checksum does not match: stored 1 vs. calculated on the restored bytes 2 [Op:RestoreV2]"),
    ("", "IndexError"),
])
def test_an_errors_reason_is_its_first_line_that_says_something(message, reason):
    from tf_multigpu.errors import error_reason
    assert error_reason(IndexError(message) if not message else RuntimeError(message)) == reason

