"""The filter-split convolution equals tf.nn.conv2d (y, dx, dw) for every geometry our models
use, on one device and with its kernel split on output channels over a 1x4 DTensor mesh."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from tf_multigpu.parallel.split_conv import split_conv2d

U = dtensor.UNSHARDED
# (batch, H, W, cin, cout, kh, kw, stride, padding): AlexNet's conv1 (11x11/4 on 227 and 224),
# 5x5 and 3x3 SAME, and odd strides, rectangles and 1x1 that the same code must get right.
CASES = {
    "alexnet_conv1_227": (2, 227, 227, 3, 8, 11, 11, 4, "VALID"),
    "conv1_224_same": (2, 224, 224, 3, 8, 11, 11, 4, "SAME"),
    "5x5_s1_same": (2, 13, 13, 6, 8, 5, 5, 1, "SAME"),
    "3x3_s1_same": (2, 9, 9, 6, 8, 3, 3, 1, "SAME"),
    "3x3_s2_same_odd": (2, 9, 11, 5, 8, 3, 3, 2, "SAME"),
    "rect_3x5_valid": (2, 10, 12, 5, 8, 3, 5, 1, "VALID"),
    "2x2_s3_same": (2, 10, 10, 3, 8, 2, 2, 3, "SAME"),
    "1x1": (2, 6, 6, 5, 8, 1, 1, 1, "SAME"),
}


def _data(case):
    b, h, w, ci, co, kh, kw, s, pad = case
    rs = np.random.RandomState(0)
    x = rs.randn(b, h, w, ci).astype(np.float32)
    k = (rs.randn(kh, kw, ci, co) / np.sqrt(kh * kw * ci)).astype(np.float32)
    return tf.constant(x), tf.constant(k), s, pad


def _forward_backward(conv, x, k, s, pad):
    with tf.GradientTape() as tape:
        tape.watch([x, k])
        y = conv(x, k, s, pad)
        loss = tf.reduce_sum(y * tf.sin(y))   # a non-trivial upstream gradient
    dx, dk = tape.gradient(loss, [x, k])
    return y, dx, dk


def _assert_close(got, want, name):
    err = np.abs(np.asarray(got) - np.asarray(want)).max() / max(1.0, np.abs(np.asarray(want)).max())
    assert err < 2e-5, f"{name}: max error {err:.2e} relative to max |ref|"


@pytest.mark.parametrize("name", CASES)
def test_equals_tf_nn_conv2d(name):
    x, k, s, pad = _data(CASES[name])
    want = _forward_backward(tf.nn.conv2d, x, k, s, pad)
    got = _forward_backward(split_conv2d, x, k, s, pad)
    for g, w, what in zip(got, want, ("y", "dx", "dw")):
        _assert_close(g, w, f"{name} {what}")


@pytest.mark.parametrize("name", ["alexnet_conv1_227", "5x5_s1_same", "3x3_s2_same_odd"])
def test_kernel_split_on_output_channels_over_4_devices(name, devices):
    mesh = dtensor.create_mesh([("batch", 1), ("model", 4)], devices=[d.split("device:")[-1] for d in devices[:4]])
    x, k, s, pad = _data(CASES[name])
    want = _forward_backward(tf.nn.conv2d, x, k, s, pad)

    def put(t, specs):
        rep = dtensor.copy_to_mesh(t, dtensor.Layout.replicated(mesh, t.shape.rank))
        return dtensor.relayout(rep, dtensor.Layout(specs, mesh))

    xd, kd = put(x, ["batch", U, U, U]), put(k, [U, U, U, "model"])
    y, dx, dk = tf.function(lambda a, b: _forward_backward(split_conv2d, a, b, s, pad))(xd, kd)
    assert dtensor.fetch_layout(y).sharding_specs == ["batch", U, U, "model"]
    assert dtensor.fetch_layout(dk).sharding_specs == [U, U, U, "model"]
    assert dtensor.unpack(y)[0].shape[-1] == want[0].shape[-1] // 4   # each device: 1/4 of the channels

    def full(t):
        return dtensor.unpack(dtensor.relayout(t, dtensor.Layout.replicated(mesh, t.shape.rank)))[0]

    for g, w, what in zip((y, dx, dk), want, ("y", "dx", "dw")):
        _assert_close(full(g), w, f"{name} {what}")
