"""Shared test helpers: one training step under any strategy, weight comparisons, checkpoint
surgery, and serving an export from a fresh TensorFlow-only process."""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf

from tests.launcher import run_code
from tf_multigpu.config import Config
from tf_multigpu.training.run import build_run


def load_digits_batch(size=64):
    """(source, preprocessed images, labels): the first `size` training digits, the parity
    checks' batch (the `digits_batch` fixture; tests/parity_worker.py in its own process)."""
    from tf_multigpu.data import load_source
    source = load_source("digits")
    images, labels = next(iter(source.train_records().batch(size)))
    return source, source.preprocess(images), labels


def one_step(strategy, devices, source, images, labels, steps=1, model="small_convnet",
             learning_rate=1.0, mesh="", layout="filter_split", **cfg_kwargs):
    """Initial and final weights (numpy; BatchNorm's moving statistics included) after `steps`
    SGD steps on the same global batch, with the model's real dropout: a run in memory
    (build_run, as the training loop builds it) fed `images, labels` every step."""
    cfg = Config(strategy=strategy, model=model, batch_size=len(labels), steps=steps, lr_schedule="constant",
                 learning_rate=learning_rate, mesh=mesh, layout=layout, **cfg_kwargs)
    run = build_run(cfg, devices, source=source)
    before = Weights([run.par.to_numpy(v) for v in run.model.weights], run.model)   # moving statistics too
    batch = tf.data.Dataset.from_tensors((images, labels)).repeat()
    run.train_fn(iter(run.par.distribute(lambda b: batch.unbatch().batch(b, drop_remainder=True))), tf.constant(steps))
    return before, [run.par.to_numpy(v) for v in run.model.weights]


class Weights(list):
    """A model's weights as arrays; `.trainable[i]` says whether weight i is trained by the
    optimizer (else it is a statistic, e.g. BatchNormalization's moving mean)."""

    def __init__(self, arrays, model):
        super().__init__(arrays)
        trainable = {id(v) for v in model.trainable_weights}
        self.trainable = [id(v) in trainable for v in model.weights]


def statistics_difference(before, after_a, after_b):
    """max_update_difference over the non-trainable weights (moving statistics) only: their
    update is a forward quantity (the batch's mean and variance), free of the cancellation that
    makes BatchNorm's backward sensitive to summation order."""
    keep = [i for i, trainable in enumerate(before.trainable) if not trainable]
    if not keep:
        return 0.0
    return max_update_difference(*([x[i] for i in keep] for x in (before, after_a, after_b)))


def max_update_difference(before, after_a, after_b):
    """max over variables of |Δa - Δb|_max / |Δb|_max: how far update a is from update b.

    A variable whose exact update is zero (a convolution's bias before a training-mode
    BatchNormalization: the normalisation subtracts it out again) moves only by rounding in
    both runs, and its relative difference is noise over noise. Where b moves it by less than
    1e-6 of the largest update of the step, the difference is taken relative to that largest
    update instead: such a variable must stay (almost) still in run a too.
    """
    deltas_b = [b - w0 for w0, b in zip(before, after_b)]
    largest = max(float(np.abs(d).max()) for d in deltas_b)
    assert largest > 0, "no variable changed: the step is not training"
    worst = 0.0
    for w0, a, delta_b in zip(before, after_a, deltas_b):
        scale = float(np.abs(delta_b).max())
        if scale < 1e-6 * largest:
            scale = largest
        worst = max(worst, float(np.abs((a - w0) - delta_b).max() / scale))
    return worst


def checkpoint_values(run_dir):
    """Every saved variable of the run's latest checkpoint, by checkpoint key."""
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(os.path.join(run_dir, "checkpoints")))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if not name.startswith("_CHECKPOINTABLE_OBJECT_GRAPH") and "save_counter" not in name}


def keep_only_checkpoint(run_dir, step):
    """Leaves the run directory as a run killed right after checkpoint `step` would."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    for f in glob.glob(os.path.join(ckpt_dir, "ckpt-*")):
        if not os.path.basename(f).startswith(f"ckpt-{step}."):
            os.remove(f)
    tf.compat.v1.train.update_checkpoint_state(ckpt_dir, os.path.join(ckpt_dir, f"ckpt-{step}"))


_SERVE_DIGITS = """
import json, sys, numpy as np, tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
d = load_digits()
_, x, _, y = train_test_split(d.images.astype(np.uint8)[..., None], d.target, test_size=0.2,
                              random_state=0, stratify=d.target)
out = []
for path in sys.argv[1:]:
    r = tf.saved_model.load(path).signatures["serving_default"](images=tf.constant(x))
    out.append({"accuracy": float((r["class_ids"].numpy() == y).mean()),
                "probabilities": r["probabilities"].numpy().tolist()})
print(json.dumps(out))
"""


def serve_digits(exports):
    """Accuracy and probabilities of each export on the digits test split, served by a fresh
    process that imports only TensorFlow (and scikit-learn for the data)."""
    done = run_code(_SERVE_DIGITS, *exports, timeout=200, fresh=True)   # a client with TensorFlow alone
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_RUN_AND_REPORT = """
import importlib, sys
module = importlib.import_module(sys.argv[1])
sys.argv = sys.argv[2:]
try:
    module.run()
except SystemExit as e:
    print(e.code, "tensorflow" in sys.modules)
"""


def exit_before_tensorflow(module, prog, *args):
    """Runs the command `prog ARGS` (entry point `module.run()`) in a fresh process until it
    exits: (exit status, whether TensorFlow was imported by then, its last stderr line)."""
    from tests.conftest import REPO
    done = subprocess.run([sys.executable, "-c", _RUN_AND_REPORT, module, prog, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert len(done.stdout.split()) == 2, (done.stdout, done.stderr[-2000:])   # it exited, and said how
    status, imported = done.stdout.split()
    return int(status), imported == "True", done.stderr.strip().splitlines()[-1]
