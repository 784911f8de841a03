"""fwd+bwd time of the split-aware layers (parallel/split_layers.py) against the stock
Keras layer on one device, at MobileNetV2 / ResNet(-X) / Xception-like shapes.

    python -m tools.bench_split_layers                 # batch 16, best of 7, interleaved
    python -m tools.bench_split_layers --batch=32 --repeats=7 --cases=depthwise_3x3_s1

In ONE process with 4 logical CPU devices, for each case it times one tf.function computing
the layer's output, a loss, and the gradients w.r.t. the input and the weights:
  stock    the stock Keras layer, one device (the baseline)
  split/1  the split-aware layer on plain tensors, one device (the formulation's overhead)
  split/1x2, split/2x2  the split-aware layer on a DTensor mesh, input split on channels
The columns after the first are ratios to it (> 1: slower). Each measurement is the fastest
of --repeats, all variants interleaved (on a shared machine, load only adds time; the
`batchnorm` row, the stock layer in every column, shows the noise left); the logical devices
share 2 cores, so the meshes show overhead, not speedup.
"""

import time

from absl import flags

from tf_multigpu import cli

PROG = "bench_split_layers"

flags.DEFINE_integer("batch", 16, "Batch size of every case.")
flags.DEFINE_integer("repeats", 7, "Timed calls per variant (interleaved); the fastest is reported.")
flags.DEFINE_list("cases", [], "Cases to run (default: all).")
FLAGS = flags.FLAGS


def cases(keras, M):
    """name -> (input HWC, stock layer factory, split-aware factory)."""
    from tf_multigpu.parallel.split_layers import SlicePool2D
    return {
        "depthwise_3x3_s1 56x56x144 (MobileNetV2 block 2)":
            ((56, 56, 144), lambda: keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False),
             lambda: M.SplitDepthwiseConv2D(3, padding="same", use_bias=False)),
        "depthwise_3x3_s2 57x57x144 valid (block 3)":
            ((57, 57, 144), lambda: keras.layers.DepthwiseConv2D(3, 2, padding="valid", use_bias=False),
             lambda: M.SplitDepthwiseConv2D(3, 2, padding="valid", use_bias=False)),
        "separable_3x3 19x19x728 (Xception middle)":
            ((19, 19, 728), lambda: keras.layers.SeparableConv2D(728, 3, padding="same", use_bias=False),
             lambda: M.SplitSeparableConv2D(728, 3, padding="same", use_bias=False)),
        "grouped_3x3_g32 28x28x256 (ResNeXt-50 stage 2)":
            ((28, 28, 256), lambda: keras.layers.Conv2D(256, 3, padding="same", groups=32, use_bias=False),
             lambda: M.SplitGroupedConv2D(256, 3, padding="same", groups=32, use_bias=False)),
        "avg_pool_2x2 56x56x128 (DenseNet transition)":
            ((56, 56, 128), lambda: keras.layers.AveragePooling2D(2), lambda: M.SliceAvgPool2D(2)),
        "avg_pool_3x3_s1_same 28x28x256 (Inception)":
            ((28, 28, 256), lambda: keras.layers.AveragePooling2D(3, 1, padding="same"),
             lambda: M.SliceAvgPool2D(3, 1, padding="same")),
        "max_pool_3x3_s2 55x55x96 (AlexNet pool1)":
            ((55, 55, 96), lambda: keras.layers.MaxPooling2D(3, 2), lambda: SlicePool2D(3, 2)),
        "max_pool_3x3_s2_same 112x112x64 (ResNet-50 stem)":
            ((112, 112, 64), lambda: keras.layers.MaxPooling2D(3, 2, padding="same"),
             lambda: SlicePool2D(3, 2, padding="same")),
        "batchnorm 28x28x512 (ResNet-50 stage 2, stock both)":
            ((28, 28, 512), lambda: keras.layers.BatchNormalization(), lambda: keras.layers.BatchNormalization()),
    }


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
    cli.start_tensorflow()
    from tf_multigpu.parallel import configure_devices
    devices = configure_devices(cpu_devices=4)
    import keras
    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    from tf_multigpu.parallel import split_layers as M

    U = dtensor.UNSHARDED
    meshes = {f"{b}x{m}": dtensor.create_mesh([("batch", b), ("model", m)],
                                              devices=[d.split("device:")[-1] for d in devices[:b * m]])
              for b, m in ((1, 2), (2, 2))}

    def put(mesh, value, specs):
        value = tf.convert_to_tensor(value)
        return dtensor.relayout(dtensor.copy_to_mesh(value, dtensor.Layout.replicated(mesh, value.shape.rank)),
                                dtensor.Layout(specs, mesh))

    def build(make, shape, mesh=None):
        specs = getattr(make(), "VARIABLE_SPECS", M.STOCK_VARIABLE_SPECS.get(type(make()), {}))

        def creator(next_creator, **kw):
            init = kw["initial_value"]
            init = tf.convert_to_tensor(init() if callable(init) else init, dtype=kw.get("dtype"))
            spec = specs.get(kw["name"])
            layout = [U if a == "-" else a for a in spec.split(",")] if spec else [U] * init.shape.rank
            return dtensor.DVariable(put(mesh, init, layout), trainable=kw.get("trainable", True), name=kw["name"])

        if mesh is None:
            layer = make()
            layer.build(shape)
            return layer
        with tf.variable_creator_scope(creator):
            layer = make()
            layer.mesh = mesh
            layer.build(shape)
        return layer

    def step_fn(layer):
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(y * y)
            return tape.gradient(loss, [x, *[v.value for v in layer.trainable_weights]])
        return step

    def sync(out):
        for t in out:
            (dtensor.unpack(t)[0] if dtensor.is_dtensor(t) else t).numpy()

    rows = []
    for name, (hwc, stock, split) in cases(keras, M).items():
        if FLAGS.cases and not any(name.startswith(c) for c in FLAGS.cases):
            continue
        shape = (FLAGS.batch, *hwc)
        x = np.random.RandomState(0).randn(*shape).astype(np.float32)
        variants = {"stock": (step_fn(build(stock, shape)), tf.constant(x)),
                    "split/1": (step_fn(build(split, shape)), tf.constant(x))}
        for mesh_name, mesh in meshes.items():
            variants[f"split/{mesh_name}"] = (step_fn(build(split, shape, mesh)),
                                              put(mesh, x, ["batch", U, U, "model"]))
        times = {k: [] for k in variants}
        for fn, arg in variants.values():
            sync(fn(arg))   # trace and warm up
        for _ in range(FLAGS.repeats):
            for k, (fn, arg) in variants.items():
                start = time.perf_counter()
                sync(fn(arg))
                times[k].append(time.perf_counter() - start)
        med = {k: min(v) for k, v in times.items()}   # best of N: load spikes only add time
        rows.append((name, med))
        print(f"{name}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items()), flush=True)

    keys = list(rows[0][1]) if rows else []
    print(f"\n| layer, batch {FLAGS.batch}, fwd+bwd | stock, 1 device (ms) | " + " | ".join(keys[1:]) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in keys[1:]) + " |")
    for name, med in rows:
        print(f"| {name} | {med['stock'] * 1e3:.1f} | "
              + " | ".join(f"{med[k] / med['stock']:.2f}x" for k in keys[1:]) + " |")


def run():
    """Entry point: `python -m tools.bench_split_layers`."""
    cli.run(main, PROG)


if __name__ == "__main__":
    run()
