"""BatchNormalization whose backward keeps only its input, for DTensor meshes.

On one device a stock BatchNormalization keeps its input for the backward and nothing else of
its size (BUILD_NOTES.md, "Twenty-third session"). On a DTensor mesh it keeps two more tensors
of its output's size until the backward: `x * inv` from tf.nn.batch_normalization, and the
gradient's `x - mean` (SquaredDifference's), which depends on forward tensors only, so the
executor computes it during the forward (measured on a model 1x2 mesh with xprof's memory
profile: both, for every BatchNorm, alive at the backward's peak). Grappler removes them on
one device; DTensor's lowered step keeps them.

`LeanBatchNormalization` (the same config, weights and name; a drop-in for the stock layer)
computes the training step's normalisation with a hand-written gradient:

    forward    mean, var = moments(x)           (tf.nn.moments, as Keras: same values)
               y = x * (gamma * inv) + (beta - mean * gamma * inv),   inv = rsqrt(var + eps)
    backward   xhat = (x - mean) * inv           from x after dy (a data dependency)
               dbeta = sum(dy), dgamma = sum(dy * xhat)
               dx = gamma * inv * (dy - dbeta / n - xhat * dgamma / n)

so what it keeps is x (its producer's output, which the stock layer keeps too) and per-channel
vectors. The moving statistics are updated as the stock layer updates them. Inference, a
mask, renormalisation, an axis other than the last, or half-precision inputs run the stock
layer's call unchanged.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tf_multigpu.parallel.windows import one_after


class LeanBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization with a backward that keeps only its input."""

    def call(self, inputs, training=None, mask=None):
        rank = len(inputs.shape)
        if not (training and self.trainable) or mask is not None or self.renorm or self.synchronized \
                or self.axis not in (-1, rank - 1) or inputs.dtype not in (tf.float32, tf.float64):
            return super().call(inputs, training=training, mask=mask)
        channels = inputs.shape[-1]
        gamma = tf.cast(self.gamma, inputs.dtype) if self.scale else tf.ones([channels], inputs.dtype)
        beta = tf.cast(self.beta, inputs.dtype) if self.center else tf.zeros([channels], inputs.dtype)
        y, mean, variance = _batch_norm(inputs, gamma, beta, self.epsilon)
        # as keras.layers.BatchNormalization updates them
        moving_mean = tf.cast(self.moving_mean, inputs.dtype)
        moving_variance = tf.cast(self.moving_variance, inputs.dtype)
        self.moving_mean.assign(moving_mean * self.momentum + mean * (1.0 - self.momentum))
        self.moving_variance.assign(moving_variance * self.momentum + variance * (1.0 - self.momentum))
        return tf.cast(y, self.compute_dtype)


def _batch_norm(x, gamma, beta, epsilon: float):
    """(y, mean, variance) of a training step over every axis but the last, with the
    gradient of y only (the statistics feed the moving averages, never the loss)."""
    axes = list(range(len(x.shape) - 1))

    @tf.custom_gradient
    def normalise(x, gamma, beta):
        mean, variance = tf.nn.moments(x, axes)
        inv = tf.math.rsqrt(variance + epsilon)
        scale = gamma * inv
        y = x * scale + (beta - mean * scale)

        def grad(dy, *_):   # the statistics' upstream gradients: zero, see above
            xhat = (x * one_after(dy, x) - mean) * inv   # made after dy, not held from the forward
            dbeta = tf.reduce_sum(dy, axes)
            dgamma = tf.reduce_sum(dy * xhat, axes)
            n = _count(x, axes)
            return scale * (dy - dbeta / n - xhat * (dgamma / n)), dgamma, dbeta

        return (y, mean, variance), grad

    return normalise(x, gamma, beta)


def _count(x, axes):
    """Values per channel, as x's dtype (static where the shape is known)."""
    dims = [x.shape[a] for a in axes]
    if all(d is not None for d in dims):
        return tf.constant(float(np.prod(dims)), x.dtype)
    return tf.cast(tf.size(x) // tf.shape(x)[-1], x.dtype)


def lean_batch_norm(layer):
    """A stock BatchNormalization as a LeanBatchNormalization of the same config; any other
    layer as it is (for a clone_function)."""
    if type(layer) is keras.layers.BatchNormalization:
        return LeanBatchNormalization.from_config(layer.get_config())
    return layer
