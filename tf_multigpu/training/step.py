"""What one step computes, seen from one replica: small pure functions returning scalars.

The loop wraps these in the parallelism (strategy.run, or a DTensor function over the mesh)
and sums the returned scalars over replicas; means are formed from sums and counts on the host.
"""

import keras
import tensorflow as tf

from tf_multigpu.parallel.windows import taps_unrolled

# What every step returns: float32 scalars, summed over replicas (and steps) by the loop.
SCALARS = ("loss_sum", "correct", "count")


def make_train_step(model, optimizer, global_batch: int, jit_compile: bool = False):
    """(images, labels) -> {loss_sum, correct, count}, after one SGD update.

    With `jit_compile`, XLA compiles the forward and backward pass (one replica's share); the
    gradient all-reduce and the update stay outside it, in the strategy's hands.
    """

    def gradients(images, labels):
        with tf.GradientTape() as tape:
            logits = _loss_precision(model(images, training=True))
            per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            # Average over the GLOBAL batch, not this replica's share: the all-reduce sums the
            # replicas' gradients, so each must be its part of the global mean. The update then
            # equals one device's on the whole batch, whatever the number of replicas.
            loss = tf.reduce_sum(per_example) / global_batch
            # float16: multiply by the loss scale (the optimizer divides it out); else a no-op.
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        return grads, _sums(per_example, logits, labels, tf.ones_like(per_example))

    if jit_compile:
        gradients = tf.function(gradients, jit_compile=True)

    def train_step(images, labels):
        grads, sums = gradients(images, labels)
        optimizer.apply(grads, model.trainable_variables)
        return sums

    train_step.scalars = SCALARS
    return train_step


def make_eval_step(model):
    """(images, labels, weights) -> {loss_sum, correct, count} over rows with weight 1."""

    def eval_step(images, labels, weights):
        # No while loops: DTensor may give this function's loops the names of the train
        # step's (windows.taps_unrolled).
        with taps_unrolled():
            logits = _loss_precision(model(images, training=False))
        per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        return _sums(per_example, logits, labels, weights)

    eval_step.scalars = SCALARS
    return eval_step


def _loss_precision(logits):
    """Logits in the precision the loss is computed in: mixed precision's bfloat16/float16
    logits in float32; float32 and float64 (the parity checks' exact mode, whose loss must not
    round to float32 either) as they are."""
    return tf.cast(logits, tf.float32) if logits.dtype.size < 4 else logits


def _sums(per_example, logits, labels, weights):
    weights = tf.cast(weights, tf.float32)
    hits = tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), labels), tf.float32)
    sums = {
        "loss_sum": tf.reduce_sum(tf.cast(per_example, tf.float32) * weights),
        "correct": tf.reduce_sum(hits * weights),
        "count": tf.reduce_sum(weights),
    }
    assert tuple(sums) == SCALARS
    return sums
