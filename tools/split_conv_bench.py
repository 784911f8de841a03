"""Forward+backward time of split_conv2d against tf.nn.conv2d, per AlexNet conv layer.

    python -m tools.split_conv_bench --batch_size=64 --image_size=224

Both run on one device, in one process, alternately (so machine load hits both alike), and
the ratio of their best times is printed per layer: the cost of writing the convolution with
ops DTensor accepts for a kernel sharded on output channels. The first layer computes no
input gradient in either (nothing upstream needs one), the others do. --chunk_mib sweeps the
patch-chunk budget of split_conv2d (its CHUNK_BYTES).
"""

import time

import numpy as np
from absl import flags

from tf_multigpu import cli

PROG = "split_conv_bench"
CHUNK_MIB = 32   # split_conv.CHUNK_BYTES (not imported here: that would start TensorFlow before the flags)
tf = None        # TensorFlow, started quietly in main

flags.DEFINE_integer("batch_size", 64, "Images per call.")
flags.DEFINE_integer("image_size", 224, "AlexNet input size.")
flags.DEFINE_integer("repeats", 3, "Timed calls per implementation and layer (best is kept).")
flags.DEFINE_list("chunk_mib", [str(CHUNK_MIB)], "Patch-chunk budgets of split_conv2d to time, MiB.")
flags.DEFINE_list("layers", [], "Only these conv layers (default: all).")
FLAGS = flags.FLAGS


def conv_geometries(image_size: int):
    """(name, input shape [H, W, C], kernel shape, stride, padding) of AlexNet's conv layers."""
    from tf_multigpu.models import build_model
    model = build_model("alexnet", (image_size, image_size, 3), 1000)
    return [(layer.name, tuple(layer.input.shape[1:]), tuple(layer.kernel.shape), layer.strides[0],
             layer.padding.upper()) for layer in model.layers if isinstance(layer, tf.keras.layers.Conv2D)]


def fwd_bwd(conv, x, w, with_dx: bool):
    """A compiled forward+backward of conv(x, w), returning the gradients' sums (cheap)."""
    @tf.function
    def run():
        with tf.GradientTape() as tape:
            tape.watch([x, w] if with_dx else [w])
            y = conv(x, w)
            loss = tf.reduce_sum(y * y)
        grads = tape.gradient(loss, [x, w] if with_dx else [w])
        return [tf.reduce_sum(g) for g in grads]
    return lambda: [t.numpy() for t in run()]


def main(argv):
    global tf
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
    tf = cli.start_tensorflow()
    tf.get_logger().setLevel("ERROR")   # one tf.function per implementation and layer: retracing is expected
    from tf_multigpu.parallel.split_conv import CHUNK_BYTES, split_conv2d
    assert CHUNK_BYTES == CHUNK_MIB * 2**20, "keep CHUNK_MIB in step with split_conv.CHUNK_BYTES"
    rs = np.random.RandomState(0)
    print(f"batch {FLAGS.batch_size}, image {FLAGS.image_size}; best of {FLAGS.repeats}, fwd+bwd, one device")
    print("| layer | input | kernel / stride | tf.nn.conv2d ms | " +
          " | ".join(f"split {c} MiB ms | ratio" for c in FLAGS.chunk_mib) + " |")
    print("| --- | --- | --- | ---: | " + " | ".join("---: | ---:" for _ in FLAGS.chunk_mib) + " |")
    for index, (name, shape, kshape, stride, padding) in enumerate(conv_geometries(FLAGS.image_size)):
        if FLAGS.layers and name not in FLAGS.layers:
            continue
        x = tf.constant(rs.randn(FLAGS.batch_size, *shape).astype(np.float32))
        w = tf.constant((rs.randn(*kshape) / np.sqrt(np.prod(kshape[:3]))).astype(np.float32))
        with_dx = index > 0
        runs = {"stock": fwd_bwd(lambda a, b, s=stride, p=padding: tf.nn.conv2d(a, b, s, p), x, w, with_dx)}
        for c in FLAGS.chunk_mib:
            runs[c] = fwd_bwd(lambda a, b, c=c, s=stride, p=padding, d=with_dx: split_conv2d(
                a, b, s, p, need_input_grad=d, chunk_bytes=int(float(c) * 2**20)), x, w, with_dx)
        best = {k: float("inf") for k in runs}
        for fn in runs.values():
            fn()   # trace and warm up
        for _ in range(FLAGS.repeats):   # interleaved: load changes hit every implementation
            for k, fn in runs.items():
                start = time.perf_counter()
                fn()
                best[k] = min(best[k], time.perf_counter() - start)
        cells = " | ".join(f"{best[c] * 1e3:.0f} | {best[c] / best['stock']:.2f}" for c in FLAGS.chunk_mib)
        print(f"| {name} | {'x'.join(map(str, shape))} | {kshape[0]}x{kshape[1]}/{stride} {kshape[2]}->{kshape[3]} | "
              f"{best['stock'] * 1e3:.0f} | {cells} |", flush=True)


def run():
    """Entry point: `python -m tools.split_conv_bench`."""
    cli.run(main, PROG)


if __name__ == "__main__":
    run()
