"""Shared test helpers: one training step under any strategy, and weight comparisons."""

import numpy as np
import tensorflow as tf

from tf_multigpu.config import Config
from tf_multigpu.parallel import make_parallelism
from tf_multigpu.training.loop import build_model_and_optimizer
from tf_multigpu.training.step import make_train_step


def one_step(strategy, devices, source, images, labels, steps=1, model="small_convnet",
             learning_rate=1.0, mesh="", layout="filter_split", **cfg_kwargs):
    """Initial and final weights (numpy) after `steps` SGD steps on the same global batch."""
    global_batch = len(labels)
    cfg = Config(run_dir="unused", strategy=strategy, model=model, batch_size=global_batch,
                 lr_schedule="constant", learning_rate=learning_rate, **cfg_kwargs)
    par = make_parallelism(strategy, devices, global_batch, mesh=mesh, layout=layout)
    # Dropout draws different masks on N replicas than on one device, so parity is checked
    # on the deterministic network (dropout=0); everything else is the real model.
    model_, optimizer = build_model_and_optimizer(cfg, par, source, steps, dropout=0.0)
    before = [par.to_numpy(v) for v in model_.trainable_variables]
    batch = tf.data.Dataset.from_tensors((images, labels)).repeat()
    it = iter(par.distribute(lambda b: batch.unbatch().batch(b, drop_remainder=True)))
    fn = par.compile(make_train_step(model_, optimizer, global_batch))
    fn(it, tf.constant(steps))
    return before, [par.to_numpy(v) for v in model_.trainable_variables]


def max_update_difference(before, after_a, after_b):
    """max over variables of |Δa - Δb|_max / |Δb|_max: how far update a is from update b."""
    worst = 0.0
    for w0, a, b in zip(before, after_a, after_b):
        delta_b = b - w0
        scale = np.abs(delta_b).max()
        assert scale > 0, "a variable did not change: the step is not training it"
        worst = max(worst, float(np.abs((a - w0) - delta_b).max() / scale))
    return worst
