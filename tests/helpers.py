"""Shared test helpers: one training step under any strategy, weight comparisons, checkpoint
surgery, and serving an export from a fresh TensorFlow-only process."""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf

from tf_multigpu.config import Config
from tf_multigpu.parallel import make_parallelism
from tf_multigpu.training.loop import build_model_and_optimizer
from tf_multigpu.training.step import make_train_step


def one_step(strategy, devices, source, images, labels, steps=1, model="small_convnet",
             learning_rate=1.0, mesh="", layout="filter_split", **cfg_kwargs):
    """Initial and final weights (numpy; BatchNorm's moving statistics included) after `steps`
    SGD steps on the same global batch, with the model's real dropout."""
    global_batch = len(labels)
    cfg = Config(run_dir="unused", strategy=strategy, model=model, batch_size=global_batch,
                 lr_schedule="constant", learning_rate=learning_rate, **cfg_kwargs)
    par = make_parallelism(strategy, devices, global_batch, mesh=mesh, layout=layout, batchnorm=cfg.batchnorm)
    model_, optimizer = build_model_and_optimizer(cfg, par, source, steps)
    before = [par.to_numpy(v) for v in model_.weights]
    batch = tf.data.Dataset.from_tensors((images, labels)).repeat()
    it = iter(par.distribute(lambda b: batch.unbatch().batch(b, drop_remainder=True)))
    fn = par.compile(make_train_step(model_, optimizer, global_batch, jit_compile=cfg.xla))
    fn(it, tf.constant(steps))
    return before, [par.to_numpy(v) for v in model_.weights]


def max_update_difference(before, after_a, after_b):
    """max over variables of |Δa - Δb|_max / |Δb|_max: how far update a is from update b."""
    worst = 0.0
    for w0, a, b in zip(before, after_a, after_b):
        delta_b = b - w0
        scale = np.abs(delta_b).max()
        assert scale > 0, "a variable did not change: the step is not training it"
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
    from tests.conftest import REPO
    done = subprocess.run([sys.executable, "-c", _SERVE_DIGITS, *exports], capture_output=True, text=True,
                          cwd=REPO, timeout=200)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
