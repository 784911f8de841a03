"""LeanBatchNormalization (parallel/lean_batchnorm.py), the BatchNorm a DTensor mesh runs:
the stock layer's output, input gradient, weight gradients and moving statistics, in float64
and float32; outside a training step, the stock call itself."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_multigpu.parallel.lean_batchnorm import LeanBatchNormalization, lean_batch_norm


def _step(layer, x, dy, training=True):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=training)
        loss = tf.reduce_sum(y * dy)
    grads = tape.gradient(loss, [x] + layer.trainable_weights)
    return [y, *grads, layer.moving_mean, layer.moving_variance]


@pytest.mark.parametrize("dtype, tol", [("float64", 1e-12), ("float32", 2e-5)])
@pytest.mark.parametrize("shape, config", [
    ((6, 5, 4, 3), {}),
    ((6, 5, 4, 3), {"center": False, "momentum": 0.9, "epsilon": 1e-5}),
    ((6, 5, 4, 3), {"scale": False}),
    ((16, 7), {}),   # after a Dense layer
])
def test_lean_batch_norm_equals_the_stock_layer(dtype, tol, shape, config):
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(*shape) * 3 + 1, dtype)
    dy = tf.constant(rng.randn(*shape), dtype)
    stock = keras.layers.BatchNormalization(dtype=dtype, **config)
    lean = LeanBatchNormalization.from_config(stock.get_config())
    stock.build(shape)
    lean.build(shape)
    for w, v in zip(stock.weights, lean.weights):   # non-trivial gamma and beta
        v.assign(rng.rand(*w.shape) + 0.5)
        w.assign(v)
    for training in (True, False):
        want, got = _step(stock, x, dy, training), _step(lean, x, dy, training)
        assert len(want) == len(got)
        for a, b in zip(want, got):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=tol, atol=tol)


def test_only_a_stock_batch_norm_is_replaced():
    stock = keras.layers.BatchNormalization(momentum=0.5, name="bn")
    lean = lean_batch_norm(stock)
    assert type(lean) is LeanBatchNormalization and lean.name == "bn" and lean.momentum == 0.5
    dense = keras.layers.Dense(3)
    assert lean_batch_norm(dense) is dense
