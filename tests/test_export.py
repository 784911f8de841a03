"""Export: from any strategy, a SavedModel that a process knowing only TensorFlow serves with
the trained model's predictions; the same export again from a checkpoint; the Keras file;
and failures that are one line, exit status 2, and leave the earlier export as it was."""

import hashlib
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import DEVICES
from tests.helpers import exit_before_tensorflow
from tests.launcher import run_code, run_module
from tf_multigpu.config import Config
from tf_multigpu.data import load_source
from tf_multigpu.errors import UsageError
from tf_multigpu.export import KERAS_FILE, METADATA_FILE, export_saved_model, from_checkpoint
from tf_multigpu.models import build_model
from tf_multigpu.training import loop

USAGE_ERROR = 2
STRATEGIES = {"single": 1, "data": 2}   # strategy -> logical devices
SAVED_MODEL_CLI = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")

# Run in a fresh process that imports only TensorFlow (and scikit-learn for the test split):
# serves every export named in argv[2:] through both signatures, saves the outputs to argv[1].
SERVE = """
import sys, numpy as np, tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
d = load_digits()
_, x, _, y = train_test_split(d.images.astype(np.uint8)[..., None], d.target, test_size=0.2,
                              random_state=0, stratify=d.target)
out = {}
for i, path in enumerate(sys.argv[2:]):
    loaded = tf.saved_model.load(path)
    for name, images in [("serving_default", x), ("serving_float", x.astype(np.float32))]:
        result = loaded.signatures[name](images=tf.constant(images))
        out[f"{i}/{name}/probabilities"] = result["probabilities"].numpy()
        out[f"{i}/{name}/class_ids"] = result["class_ids"].numpy()
assert not any(m.startswith("tf_multigpu") for m in sys.modules), "the client imported our package"
np.savez(sys.argv[1], labels=y, **out)
"""


def _export_cli(*args, timeout=120):
    """Runs `python -m tf_multigpu.export_main ARGS` in a process of its own."""
    return run_module("tf_multigpu.export_main", *args, timeout=timeout)


def _one_error_line(done):
    """The single `tf-multigpu-export: error:` line of a failed command, which must end stderr."""
    errors = [line for line in done.stderr.splitlines() if line.startswith("tf-multigpu-export: error:")]
    assert done.returncode == USAGE_ERROR and len(errors) == 1, done.stderr[-2000:]
    assert done.stderr.rstrip().endswith(errors[0])
    return errors[0]


def _fingerprint(root):
    """Every file under root with its content hash."""
    return {os.path.relpath(os.path.join(folder, name), root):
            hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
            for folder, _, files in os.walk(root) for name in files}


def _test_images(source):
    images, labels = zip(*source.test_records().as_numpy_iterator())
    return np.stack(images), np.array(labels)


def _train_keeping_the_live_model(cfg, devices):
    """Trains in-process; returns the summary and the trained (distributed) model itself."""
    live = {}
    original = loop.build_run

    def capture(*args, **kwargs):
        live["run"] = original(*args, **kwargs)
        return live["run"]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "build_run", capture)
        summary = loop.train(cfg, devices)
    return summary, live["run"].model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A short run per strategy, with the live trained model's logits on the test split."""
    source = load_source("digits")
    images, labels = _test_images(source)
    out = {}
    for strategy, num_devices in STRATEGIES.items():
        run_dir = str(tmp_path_factory.mktemp(strategy) / "run")
        cfg = Config(run_dir=run_dir, strategy=strategy, steps=6, batch_size=32, log_every=3, seed=3,
                     checkpoint_every=3)   # ckpt-3 and ckpt-6: an earlier checkpoint to export
        summary, model = _train_keeping_the_live_model(cfg, DEVICES[:num_devices])
        logits = model(source.preprocess(images), training=False).numpy()
        out[strategy] = {"run_dir": run_dir, "summary": summary, "logits": logits, "labels": labels,
                         "export": os.path.join(run_dir, "export")}
    return out


@pytest.fixture(scope="module")
def cli_export(runs):
    """`tf-multigpu-export` of the data-parallel run's latest checkpoint to another directory."""
    run_dir = runs["data"]["run_dir"]
    export_dir = os.path.join(run_dir, "cli_export")
    done = _export_cli(f"--run_dir={run_dir}", f"--export_dir={export_dir}")
    assert done.returncode == 0, done.stderr[-2000:]
    return export_dir, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def served(runs, cli_export, tmp_path_factory):
    """Outputs of every export, served by one fresh process that knows only TensorFlow."""
    exports = [runs[s]["export"] for s in STRATEGIES] + [cli_export[0]]
    out_file = str(tmp_path_factory.mktemp("served") / "served.npz")
    done = run_code(SERVE, out_file, *exports, timeout=120, fresh=True)   # a client with TensorFlow alone
    assert done.returncode == 0, done.stderr[-2000:]
    results = dict(np.load(out_file))
    return {path: {k.split("/", 1)[1]: v for k, v in results.items() if k.startswith(f"{i}/")}
            for i, path in enumerate(exports)} | {"labels": results["labels"]}


def _softmax(logits):
    return tf.nn.softmax(logits).numpy()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_fresh_process_serves_the_trained_models_predictions(runs, served, strategy):
    run = runs[strategy]
    out = served[run["export"]]
    np.testing.assert_array_equal(served["labels"], run["labels"])   # the same test split
    assert np.abs(out["serving_default/probabilities"] - _softmax(run["logits"])).max() <= 1e-5
    np.testing.assert_array_equal(out["serving_default/class_ids"], run["logits"].argmax(axis=1))
    accuracy = float((out["serving_default/class_ids"] == run["labels"]).mean())
    summary = json.load(open(os.path.join(run["run_dir"], "summary.json")))
    assert accuracy == pytest.approx(summary["test_accuracy"], abs=1e-9)
    # Float pixels on the stored scale give the same answers as the stored uint8 pixels.
    np.testing.assert_allclose(out["serving_float/probabilities"], out["serving_default/probabilities"],
                               atol=1e-7)
    np.testing.assert_array_equal(out["serving_float/class_ids"], out["serving_default/class_ids"])


def test_export_from_checkpoint_equals_the_end_of_run_export(runs, served, cli_export):
    export_dir, printed = cli_export
    run = runs["data"]
    end_of_run, again = served[run["export"]], served[export_dir]
    for key in end_of_run:
        np.testing.assert_allclose(again[key], end_of_run[key], atol=1e-7, err_msg=key)
    checkpoint = tf.train.latest_checkpoint(os.path.join(run["run_dir"], "checkpoints"))
    metadata = json.load(open(os.path.join(export_dir, METADATA_FILE)))
    assert printed["export_dir"] == export_dir and printed["checkpoint"] == metadata["checkpoint"] == checkpoint
    assert metadata["step"] == printed["step"] == run["summary"]["step"] == 6
    # Measured again at export on one device: the same accuracy as the run's own evaluation.
    assert metadata["metrics"]["test_accuracy"] == pytest.approx(run["summary"]["test_accuracy"], abs=1e-9)
    assert metadata["metrics"]["test_loss"] == pytest.approx(run["summary"]["test_loss"], rel=1e-4)


def test_export_of_an_earlier_checkpoint_holds_its_weights(runs, tmp_path):
    """--checkpoint=RUN_DIR/checkpoints/ckpt-3 exports step 3's weights, not the latest's."""
    run_dir = runs["single"]["run_dir"]
    earlier = os.path.join(run_dir, "checkpoints", "ckpt-3")
    export_dir = str(tmp_path / "at_step_3")
    done = _export_cli(f"--run_dir={run_dir}", f"--checkpoint={earlier}", f"--export_dir={export_dir}",
                       "--noevaluate")
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    metadata = json.load(open(os.path.join(export_dir, METADATA_FILE)))
    assert printed["step"] == metadata["step"] == 3 and printed["checkpoint"] == metadata["checkpoint"] == earlier
    kernel = keras.models.load_model(os.path.join(export_dir, KERAS_FILE)).get_layer("conv1").kernel.numpy()
    at = {step: tf.train.load_checkpoint(os.path.join(run_dir, "checkpoints", f"ckpt-{step}")) for step in (3, 6)}
    key = next(k for k, shape in at[3].get_variable_to_shape_map().items()
               if shape == list(kernel.shape) and "OPTIMIZER_SLOT" not in k)
    np.testing.assert_array_equal(kernel, at[3].get_tensor(key))
    assert not np.array_equal(kernel, at[6].get_tensor(key))


def test_metadata_describes_the_export(runs):
    run = runs["single"]
    metadata = json.load(open(os.path.join(run["export"], METADATA_FILE)))
    assert metadata["config"] == json.load(open(os.path.join(run["run_dir"], "config.json")))
    assert metadata["class_names"] == [str(d) for d in range(10)]
    assert metadata["input_shape"] == [8, 8, 1] and metadata["pixel_dtype"] == "uint8"
    assert metadata["pixel_max"] == 16.0 and metadata["step"] == 6
    assert metadata["metrics"]["test_accuracy"] == run["summary"]["test_accuracy"]
    assert metadata["keras_file"] == KERAS_FILE
    assert metadata["signatures"]["serving_float"]["inputs"]["images"] == {"dtype": "float32",
                                                                          "shape": [None, 8, 8, 1]}


def test_a_subclassed_model_is_exported_without_its_keras_file(tmp_path, caplog):
    """Keras cannot serialise a subclassed model without get_config(): the SavedModel is still
    written and serves, the Keras file is left out (not half-written), and the metadata and a
    warning say so."""
    source = load_source("digits")
    model = build_model("tests.user_models:subclassed_net", source.image_shape, source.num_classes)
    with caplog.at_level("WARNING"):
        export_dir = export_saved_model(model, source, str(tmp_path / "export"), {})
    assert "model.keras not written: Keras cannot serialise subclassed_net" in caplog.text
    assert not os.path.exists(os.path.join(export_dir, KERAS_FILE))
    assert json.load(open(os.path.join(export_dir, METADATA_FILE)))["keras_file"] is None
    images, _ = _test_images(source)
    served = tf.saved_model.load(export_dir).signatures["serving_default"](images=tf.constant(images[:4]))
    np.testing.assert_allclose(served["probabilities"].numpy().sum(-1), 1.0, atol=1e-5)


def test_saved_model_cli_lists_the_serving_signatures(runs):
    done = subprocess.run([SAVED_MODEL_CLI, "show", "--dir", runs["data"]["export"], "--all"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    signatures = {}
    for block in done.stdout.split("signature_def['")[1:]:
        signatures[block.split("'", 1)[0]] = " ".join(block.split())
    assert {"serving_default", "serving_float"} <= signatures.keys()
    for name, pixel in [("serving_default", "DT_UINT8"), ("serving_float", "DT_FLOAT")]:
        text = signatures[name]
        assert f"inputs['images'] tensor_info: dtype: {pixel} shape: (-1, 8, 8, 1)" in text, text
        assert "outputs['probabilities'] tensor_info: dtype: DT_FLOAT shape: (-1, 10)" in text, text
        assert "outputs['class_ids'] tensor_info: dtype: DT_INT32 shape: (-1)" in text, text


def test_keras_file_predicts_the_same_logits(runs):
    run = runs["data"]
    model = keras.saving.load_model(os.path.join(run["export"], KERAS_FILE))
    source = load_source("digits")
    images, _ = _test_images(source)
    logits = model(source.preprocess(images), training=False).numpy()
    np.testing.assert_allclose(logits, run["logits"], atol=1e-5)


def test_failed_export_exits_2_and_keeps_the_earlier_export(runs):
    run = runs["single"]
    before = _fingerprint(run["export"])
    blocker = os.path.join(run["run_dir"], "summary.json")   # a regular file: root cannot mkdir under it
    done = _export_cli(f"--run_dir={run['run_dir']}", f"--export_dir={blocker}/export")
    assert f"cannot write the export to {blocker}/export: {blocker} is a file" in _one_error_line(done)
    # A real failure inside the SavedModel writer: the staging directory's name is too long.
    done = _export_cli(f"--run_dir={run['run_dir']}", f"--export_dir={run['run_dir']}/{'x' * 250}")
    assert "(File name too long): choose a writable --export_dir" in _one_error_line(done)
    # Mid-write failure replacing the export in place (disk full while writing the .keras file).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(keras.Model, "save", _raise_disk_full)
        with pytest.raises(UsageError, match="cannot write the export to .*No space left"):
            from_checkpoint.export_from_checkpoint(run["run_dir"], evaluate=False)
    assert _fingerprint(run["export"]) == before
    assert sorted(os.listdir(run["run_dir"])) == ["checkpoints", "config.json", "export", "summary.json",
                                                   "tensorboard"]   # no staging directory left behind
    loaded = tf.saved_model.load(run["export"]).signatures["serving_default"]
    assert loaded(images=tf.zeros([2, 8, 8, 1], tf.uint8))["probabilities"].shape == (2, 10)


def _raise_disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("args, needle", [
    (["--run_dir=/nonexistent/run"], "--run_dir=/nonexistent/run is not a directory"),
    ([], "--run_dir is required"),
    (["--run_dir=x", "extra"], "unexpected arguments ['extra']"),
    (["--run_dir=x", "--no_such_flag"], "Unknown command line flag 'no_such_flag'"),
])
def test_bad_command_line_is_one_line_exit_2(args, needle):
    assert needle in _one_error_line(_export_cli(*args))


def test_run_without_checkpoints_is_one_line_exit_2_before_tensorflow_starts(tmp_path):
    """What the run directory's files decide is refused before TensorFlow is imported."""
    Config(run_dir=str(tmp_path)).write(str(tmp_path / "config.json"))
    for run_dir, needle in [(tmp_path, "has no checkpoint in checkpoints/: train it first"),
                            (tmp_path / "nonexistent", "is not a directory")]:
        status, imported, line = exit_before_tensorflow("tf_multigpu.export_main", "tf-multigpu-export",
                                                        f"--run_dir={run_dir}")
        assert (status, imported) == (USAGE_ERROR, False), line
        assert line.startswith("tf-multigpu-export: error: ") and needle in line, line
    assert os.listdir(tmp_path) == ["config.json"]
    # With a checkpoint: a --checkpoint that is none, an --export_dir that is a file.
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-1.index").write_bytes(b"")
    (tmp_path / "a_file").write_text("kept")
    for args, needle in [([f"--checkpoint={tmp_path / 'checkpoints' / 'ckpt-9'}"], "is not a checkpoint (no "),
                         ([f"--export_dir={tmp_path / 'a_file'}"], "is a file: give a new directory")]:
        status, imported, line = exit_before_tensorflow("tf_multigpu.export_main", "tf-multigpu-export",
                                                        f"--run_dir={tmp_path}", *args)
        assert (status, imported) == (USAGE_ERROR, False), line
        assert needle in line, line
    assert (tmp_path / "a_file").read_text() == "kept"


def test_bad_checkpoints_are_refused(runs, tmp_path):
    run_dir = runs["single"]["run_dir"]
    with pytest.raises(UsageError, match="is not a checkpoint .*without .index"):
        from_checkpoint.find_checkpoint(run_dir, os.path.join(run_dir, "checkpoints", "ckpt-999"))
    # A checkpoint without some of the model's weights must not leave them at random values.
    partial = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(32, 3, padding="same", name="conv1")])
    path = tf.train.Checkpoint(model=partial).write(str(tmp_path / "partial" / "ckpt"))
    model = build_model("small_convnet", (8, 8, 1), 10)
    with pytest.raises(UsageError, match=r"holds no value for \d+ weight\(s\) of the model \(small_convnet/"):
        from_checkpoint.restore_weights(model, path)
    # One whose shapes differ (another model) is refused too.
    other = build_model("small_convnet", (16, 16, 1), 10)
    path = tf.train.Checkpoint(model=other).write(str(tmp_path / "other" / "ckpt"))
    with pytest.raises(UsageError, match="does not fit the run's model"):
        from_checkpoint.restore_weights(model, path)


@pytest.mark.parametrize("damage", ["missing", "empty", "names_moved_files"])
def test_the_latest_checkpoint_is_found_without_its_state_file(runs, tmp_path, damage):
    """As a resumed run does (training/run_dir.py): the newest checkpoint on disk when the
    manager's state file is lost, empty, or names files moved away."""
    import shutil
    run_dir = str(tmp_path / "run")
    shutil.copytree(runs["data"]["run_dir"], run_dir)
    checkpoints = os.path.join(run_dir, "checkpoints")
    state = os.path.join(checkpoints, "checkpoint")
    if damage == "missing":
        os.remove(state)
    elif damage == "empty":
        open(state, "w").close()
    else:
        for f in os.listdir(checkpoints):
            if f.startswith("ckpt-6."):
                os.remove(os.path.join(checkpoints, f))
    newest = "ckpt-3" if damage == "names_moved_files" else "ckpt-6"
    assert from_checkpoint.find_checkpoint(run_dir) == os.path.join(checkpoints, newest)


def test_only_an_export_or_an_empty_directory_is_replaced(runs, tmp_path):
    source = load_source("digits")
    model = build_model("small_convnet", source.image_shape, source.num_classes)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="holds files that are not a SavedModel"):
        export_saved_model(model, source, str(tmp_path), {})
    with pytest.raises(UsageError, match="is a file"):
        export_saved_model(model, source, str(tmp_path / "notes.txt"), {})
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # An earlier export that a user added files to is not replaced either: it would delete them.
    export = tmp_path / "export"
    export_saved_model(model, source, str(export), {})
    export_saved_model(model, source, str(export), {})   # an export over an export: what it writes is its own
    for added in ("README.txt", os.path.join("assets.extra", "labels.txt")):
        (export / added).write_text("mine")
        with pytest.raises(UsageError, match=r"is an earlier export holding files it did not write \("
                                             + added.replace(".", r"\.") + r"\).*move them out"):
            export_saved_model(model, source, str(export), {})
        assert (export / added).read_text() == "mine"
        os.remove(export / added)

