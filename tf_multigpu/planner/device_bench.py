"""A DeviceProfile of the devices a run will use, from a micro-benchmark of a few seconds.

`measure(devices)` times, on those devices:

- compute: the model's whole forward and backward step (or, without a model, a 3x3
  convolution) on every device at once, at each per-device batch the plans run (the rate each
  device keeps while all are busy, which is what a parallel step sees; a CPU's rate grows
  with the batch), and on the first device alone at the global batch (logical CPU devices
  share the same cores, so one device alone runs up to N times faster; on GPUs the two rates
  are the same).
- the split convolution: its time over tf.nn.conv2d's on the model's convolutions, and the
  share of it that a split of the filters does not divide (the patches of the whole input).
- memory-bound work: a momentum update of 8 MiB on all devices at once and on one alone
  (every replica updates its own copy of its weights; on shared cores they share the memory
  bandwidth), and the per-operation overhead of a chain of scalar ops on all devices at once.
- the input pipeline: the run's own training batches read alone (images/s). On logical CPU
  devices the pipeline runs on the cores the devices compute on, so its time adds to every
  step (`input_shares_cores`); a GPU's step overlaps it and waits only if it is slower.
- links: a ring all-reduce among all devices (MirroredStrategy, the same collective data
  parallelism uses) of the model's gradients (bandwidth: as many tensors, in their
  proportions, so that MirroredStrategy's packing of them into one tensor and back, which a
  data-parallel step pays, is in it) and of one value each; the bandwidth is the
  per-device "bus" bandwidth, bytes = 2(N-1)/N x size over time, so that the cost model's
  ring formulas give back the measured time.
- a collective inside a step: a chain of small matmuls with a one-value all-reduce after each,
  against the same chain without them, on all devices (`collective_overhead_s`). On logical
  CPUs that is what a collective costs: the devices share the cores, and each collective makes
  them all wait for the last one (a 2-device all-reduce costs about what a 4-device one does),
  so the per-hop latency is left at 0 and every collective, of any group, costs this much.

`measure_for_run` is the one call the entry points make: the profile for a run's model,
source and global batch (tf-multigpu-plan, --strategy=auto, tools/plan_vs_measured.py).
"""

from __future__ import annotations

import math
import os
import statistics
import time

from tf_multigpu.planner.device_profile import UPDATE_BYTES_PER_PARAM_BYTE, DeviceProfile


def measure(devices, model=None, batch: int = 4, allreduce_mib: int = 0, global_batch: int = 0,
            input_dataset=None) -> DeviceProfile:
    """A profile of `devices` (TensorFlow device names) from a few-second micro-benchmark.

    With a built Keras `model`, the FLOP rates are timed on the model's whole forward and
    backward step: with all devices busy at every per-device batch a plan on these devices
    runs for the run's `global_batch` (`plan_batches`; default `batch` x the devices), and on
    one device alone at the global batch. The split convolution's overhead is timed on the
    model's own convolutions (small feature maps run far below a large layer's rate, and the
    im2col overhead grows as maps shrink, BUILD_NOTES), with a model at each of those
    per-device batches (its patches grow with the batch), else at `batch`; the all-reduce at
    the size of the model's gradients. `input_dataset`, the
    run's training batches (`input_batches`), is timed alone for the input pipeline's rate."""
    import tensorflow as tf

    convs = _model_convs(model) if model is not None else []
    convs = convs or [((16, 16, 64), (3, 3, 64, 64), 1, "SAME", True)]
    by_batch, by_dense, grad_bytes, sizes, shares = {}, {}, 0, [batch], [1]
    if model is not None:   # the whole model's step: its pooling, activations, loss and small layers too
        from tf_multigpu.planner.cost_model import analyze
        layers = analyze(model).layers
        per_example = sum(layer.fwd_flops + layer.bwd_flops for layer in layers)
        shares = [math.prod(w.shape) for w in model.trainable_weights]
        grad_bytes = sum(shares) * 4
        step = _ModelStep(devices, model, per_example)
        global_batch = global_batch or batch * len(devices)
        sizes = plan_batches(len(devices), global_batch, _batch_cap(per_example, len(devices)))
        dense = [layer for layer in layers if layer.kind == "dense"]
        dense_per_example = sum(layer.fwd_flops + layer.bwd_flops for layer in dense)
        dense_runs = {b: _dense_layers(devices, dense, b) for b in sizes} if dense else {}
        dense_s = {}
        for _ in range(2):   # interleaved rounds, the faster of each: a busy spell on shared cores passes
            for b in sizes:
                by_batch[b] = max(by_batch.get(b, 0.0), step.rate(devices, b))
                if dense:
                    dense_s[b] = min(dense_s.get(b, float("inf")), _typical_time(dense_runs[b]))
        for b in dense_s:   # split the step's time: the Dense layers' own, and the rest's
            step_s = per_example * b / by_batch[b]
            rest_s = step_s - dense_s[b]
            if dense_per_example < per_example and rest_s > 0.1 * step_s:   # else too noisy to split
                by_dense[b] = dense_per_example * b / dense_s[b]
                by_batch[b] = (per_example - dense_per_example) * b / rest_s
        flops_all = by_batch[min(sizes)]
        flops_one = step.rate(devices[:1], min(global_batch, _batch_cap(per_example, 1)))
    else:
        flops_all, flops_one = _conv_rate(devices, convs, batch), _conv_rate(devices[:1], convs, batch)
    if not allreduce_mib:   # the size a data-parallel step all-reduces: on CPUs the bandwidth falls with it
        allreduce_mib = int(min(max(grad_bytes / 2**20, 16), ALLREDUCE_MIB_CAP))
    bandwidth, _ = (float("inf"), 0.0) if len(devices) < 2 else _allreduce_rates(devices, allreduce_mib, shares)
    collective = 0.0 if len(devices) < 2 else _collective_overhead(devices)
    split = {b: _split_conv_overhead(devices, convs, b) for b in sizes}
    overhead, replicated = split[min(sizes)]
    memory_all, memory_one = _update_bandwidth(devices), _update_bandwidth(devices[:1])
    dense_rates = by_dense if len(by_dense) == len(by_batch) else {}   # all batches split, or none
    input_rate = 0.0
    if input_dataset is not None:
        from tf_multigpu.data.throughput import images_per_sec
        input_rate = images_per_sec(input_dataset, seconds=2.0)
    return DeviceProfile(
        name="measured", peak_flops_per_s=flops_all, memory_bytes=_memory_per_device(devices),
        link_bandwidth_bytes_per_s=bandwidth, link_latency_s=0.0, collective_overhead_s=collective,
        compute_efficiency=1.0,
        single_device_flops_per_s=flops_one, num_devices=len(devices), split_conv_overhead=overhead,
        split_conv_replicated=replicated,
        per_op_overhead_s=_op_overhead(devices), memory_bandwidth_bytes_per_s=memory_all,
        single_device_memory_bandwidth_bytes_per_s=memory_one, batch_flops_per_s=by_batch,
        batch_split_conv_overhead={b: o for b, (o, _) in split.items()},
        batch_dense_flops_per_s=dense_rates,
        input_images_per_s=input_rate, input_shares_cores="GPU" not in devices[0].upper(),
        description=f"measured on {len(devices)} x {devices[0]}",
        source={"method": f"{'the model' if model is not None else 'a 3x3 64->64 16x16 convolution'}'s "
                          "step, forward and backward, on all devices at once per batch and on one alone (the FLOP "
                          "rates); the model's convolutions as split convolutions (all filters and a quarter) "
                          "against tf.nn.conv2d; MomentumSGD updates of 8 MiB (memory bandwidth, "
                          f"all at once and alone); chains of tiny ops (per-op overhead); MirroredStrategy ring "
                          f"all-reduce of {allreduce_mib} MiB as {len(shares)} tensor(s) in the proportions of the "
                          "model's gradients (bandwidth, packing included); a chain of matmuls with and without a "
                          "one-value all-reduce after each (the cost of a collective in a step)"
                          + ("; the run's training batches read alone (input pipeline)" if input_rate else ""),
                **({"dense_layers": "the model's Dense layers timed alone (their matmuls forward and backward, "
                                    "all devices at once); the step's other layers at the rest of its time"}
                   if dense_rates else {}),
                "tensorflow": tf.__version__, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")})


def input_batches(source, global_batch: int, seed: int = 0):
    """The training batches a run of `source` at `global_batch` reads (data/pipeline.py), for
    `measure(input_dataset=...)`: the input pipeline's cost is the run's own."""
    from tf_multigpu.data.pipeline import train_dataset
    return train_dataset(source, seed=seed, global_batch=global_batch, batch_size=global_batch)


def measure_for_run(devices, model, source, global_batch: int, seed: int = 0) -> DeviceProfile:
    """The profile a run of `model` on `source` at `global_batch` is planned with: `measure` at
    the run's per-device batch (the global batch over all `devices`), at every per-device batch
    its plans run, with the run's own input pipeline."""
    return measure(devices, model, max(global_batch // len(devices), 1), global_batch=global_batch,
                   input_dataset=input_batches(source, global_batch, seed))


def _concurrent_seconds(devices, make_inputs, body, repeats: int = 5) -> float:
    """Typical (median) time of `body(*inputs)` run on every device of `devices` at once, in one function."""
    return _typical_time(_concurrent(devices, make_inputs, body), repeats)


def _concurrent(devices, make_inputs, body):
    """A callable running `body(*inputs)` on every device of `devices` at once, in one traced
    function, and waiting for the results: time it as often as needed, traced once."""
    import tensorflow as tf

    inputs = []
    for d in devices:
        with tf.device(d):
            inputs.append(make_inputs())

    @tf.function
    def run():
        outs = []
        for d, args in zip(devices, inputs):
            with tf.device(d):
                outs.append(body(*args))
        return outs

    return lambda: [o.numpy() for o in run()]


def _model_convs(model) -> list[tuple]:
    """(input shape, kernel shape, stride, padding, computes its input's gradient) of every
    Conv2D of a built Keras model, read from its graph (parallel/placement.model_graph). A
    convolution with no weights upstream (AlexNet's first) computes no input gradient in a
    step, as placement decides: timing one it never runs would misstate the layer (tf.nn.conv2d's
    input gradient at stride 4 costs four times its forward on CPUs, BUILD_NOTES)."""
    import keras

    from tf_multigpu.planner.cost_model import analyze
    cost = analyze(model)
    input_grad = {layer.name: layer.input_grad for layer in cost.layers}
    return [(node.in_shapes[0], node.weights[node.weight("kernel")], node.config["strides"][0],
             node.config["padding"].upper(), input_grad[node.name])
            for node in cost.nodes if issubclass(node.cls, keras.layers.Conv2D)]


def _conv_flops(convs, batch: int) -> float:
    """Forward + backward FLOPs (3x the forward's) of `convs` at `batch`."""
    total = 0.0
    for (h, w, cin), (kh, kw, _, cout), stride, padding, _ in convs:
        oh, ow = ((h + stride - 1) // stride, (w + stride - 1) // stride) if padding == "SAME" else \
            ((h - kh) // stride + 1, (w - kw) // stride + 1)
        total += 3 * 2.0 * batch * oh * ow * cout * kh * kw * cin
    return total


def _conv_rate(devices, convs, batch: int = 4) -> float:
    """FLOP/s each device sustains on `convs` forward and backward while all of `devices` run
    them: on logical CPU devices the cores are shared, so the rate with all busy is what a
    parallel step sees (and one device alone, what `single` sees)."""
    import tensorflow as tf

    def make():
        return tuple((tf.random.normal([batch, *shape]), tf.random.normal(kernel) * 0.05)
                     for shape, kernel, *_ in convs)

    def body(*pairs):
        total = tf.constant(0.0)
        for (x, w), (_, _, stride, padding, _) in zip(pairs, convs):
            with tf.GradientTape() as tape:
                tape.watch([x, w])
                y = tf.reduce_sum(tf.nn.conv2d(x, w, stride, padding))
            dx, dw = tape.gradient(y, [x, w])
            total += tf.reduce_sum(dx[:1, :1, :1]) + tf.reduce_sum(dw[:1])
        return total

    return _conv_flops(convs, batch) / _concurrent_seconds(devices, make, body)


# Largest all-reduce timed for the bandwidth (AlexNet's 238 MiB of gradients would take seconds
# on CPUs; the rate at 128 MiB is what such sizes get).
ALLREDUCE_MIB_CAP = 128
# Most FLOPs one timing of the model's step may run on all devices together: past it the rate
# is taken as the largest batch's (a rate stops growing with the batch long before; AlexNet at
# 224x224 is timed at 7 examples per device on 4 devices, not at the paper's 64).
MODEL_TIMING_FLOPS = 200e9


def plan_batches(num_devices: int, global_batch: int, cap: int = 0) -> list[int]:
    """The examples per device that the plans on `num_devices` run: the global batch split
    over each divisor of the device count (data: over all; a B x M mesh: over B), at most `cap`."""
    sizes = {max(global_batch // d, 1) for d in range(1, num_devices + 1) if num_devices % d == 0}
    return sorted({min(b, cap) for b in sizes} if cap else sizes)


def _batch_cap(flops_per_example: float, num_devices: int) -> int:
    """The largest per-device batch whose timing stays within MODEL_TIMING_FLOPS."""
    return max(1, int(MODEL_TIMING_FLOPS // max(flops_per_example * num_devices, 1.0)))


class _ModelStep:
    """The model's forward and backward pass, loss included, timed on devices at once.

    FLOP/s are the cost model's count (convolutions, dense layers, pooling), which leaves out
    activations, normalisation, dropout and the loss; on small feature maps those and the
    per-op costs are a large share of a step, so the rate is measured on the step they belong
    to. On GPUs each device gets its own copy of the weights (made once), as a replica has;
    logical CPU devices share the host's memory and read one copy."""

    def __init__(self, devices, model, flops_per_example: float):
        import keras
        import tensorflow as tf

        self.model, self.flops_per_example = model, flops_per_example
        self.runs = {}   # (devices, batch) -> the traced step, timed in every round
        self.copies = {}
        for d in devices[1:]:
            if "GPU" in d.upper():
                with tf.device(d):
                    self.copies[d] = keras.models.clone_model(model)
                    self.copies[d].set_weights(model.get_weights())

    def rate(self, devices, batch: int) -> float:
        """FLOP/s each of `devices` sustains while all run the step at `batch` examples each."""
        key = (tuple(devices), batch)
        if key not in self.runs:
            self.runs[key] = self._traced(devices, batch)
        return self.flops_per_example * batch / _typical_time(self.runs[key])

    def _traced(self, devices, batch: int):
        import tensorflow as tf

        classes = int(self.model.output_shape[-1])
        order = iter(devices)

        def make():
            return (tf.random.uniform([batch, *self.model.input_shape[1:]]),
                    tf.random.uniform([batch], maxval=classes, dtype=tf.int32),
                    self.copies.get(next(order), self.model))

        def body(x, y, net):
            with tf.GradientTape() as tape:
                logits = tf.cast(net(x, training=True), tf.float32)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            grads = tape.gradient(loss, net.trainable_variables)
            return loss + tf.add_n([tf.reduce_sum(g[:1]) for g in grads if g is not None])

        return _concurrent(devices, make, body)


def _dense_layers(devices, layers, batch: int):
    """A callable running the matmuls of the Dense `layers` (cost_model LayerCosts) forward and
    backward at `batch` examples, on every device at once: the kernel's gradient always, the
    input's where the step computes one."""
    import tensorflow as tf

    shapes = []
    for layer in layers:
        kernel = next(shape for shape in layer.weights.values() if len(shape) == 2)
        shapes.append((batch * (layer.in_elems // kernel[0]), kernel, layer.input_grad))

    def make():
        return tuple((tf.random.normal([rows, kernel[0]]), tf.random.normal(kernel) * 0.01)
                     for rows, kernel, _ in shapes)

    def body(*pairs):
        total = tf.constant(0.0)
        for (x, w), (_, _, needs_dx) in zip(pairs, shapes):
            wanted = [x, w] if needs_dx else [w]
            with tf.GradientTape() as tape:
                tape.watch(wanted)
                y = tf.reduce_sum(tf.matmul(x, w))
            total += sum(tf.reduce_sum(g[:1]) for g in tape.gradient(y, wanted))
        return total

    return _concurrent(devices, make, body)


def _update_bandwidth(devices, mib: int = 8) -> float:
    """Bytes/s each device moves in a momentum update (read w, g, v; write v, w) while all of
    `devices` run one: the memory-bound work that every replica repeats on its own weights.

    Timed on the training's own update (training/optimizer.MomentumSGD with the default weight
    decay), not on a two-line proxy: its decay and momentum run as separate ops, each a pass
    over the weights, and on 4 logical CPUs AlexNet 64's update took about 125 ms of a data x4
    step where the proxy's rate predicted 90 (BUILD_NOTES). The rate stays "bytes of the five
    passes a fused update would make per second", so a profile keeps its meaning."""
    import keras
    import tensorflow as tf

    from tf_multigpu.config.config import Config
    from tf_multigpu.training.optimizer import MomentumSGD

    n = mib * 2**20 // 4

    def make():   # a kernel (rank 2: the decay applies) and its gradient, on this device
        w = keras.Variable(tf.zeros([n // 1024, 1024]))
        optimizer = MomentumSGD(learning_rate=0.01, momentum=0.9, l2=Config().weight_decay)
        optimizer.build([w])
        return w, tf.ones([n // 1024, 1024]), optimizer

    def body(w, g, optimizer):
        optimizer.update_step(g, w, 0.01)
        return w[0, 0]

    return UPDATE_BYTES_PER_PARAM_BYTE * mib * 2**20 / _concurrent_seconds(devices, make, body)


def _op_overhead(devices, ops: int = 200) -> float:
    """Seconds per operation of a chain of dependent scalar ops on every device at once: the
    fixed cost that dominates small layers (launch, scheduling, the shared cores' switching)."""
    import tensorflow as tf

    def body(x):
        for _ in range(ops):
            x = x * 1.0001 + 1e-4
        return x

    return _concurrent_seconds(devices, lambda: (tf.constant(1.0),), body) / (2 * ops)


def _typical_time(fn, repeats: int = 5) -> float:
    """The median time of `repeats` calls of `fn`, after one to trace and warm up.

    The median, not the fastest: a plan's predicted step time is compared with a run's mean
    step time, which pays the spread of a busy machine as well as its quiet spells. On 4
    logical CPUs the median of 12 repeats of a model's step was 7-24% above the fastest
    (AlexNet 64 and small_convnet, BUILD_NOTES)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _allreduce_rates(devices, mib: int, shares=(1.0,)) -> tuple[float, float]:
    """(bus bandwidth in bytes/s per device, latency per ring hop in s) of a ring all-reduce of
    `mib` MiB in all, as one tensor per share of `shares` (give the model's gradients' shares:
    a data-parallel step all-reduces that list, which MirroredStrategy packs into one tensor
    and splits back, and the packing is part of what the step pays)."""
    import tensorflow as tf

    from tf_multigpu.compat import new_mirrored_collective_keys

    new_mirrored_collective_keys()   # keys of its own: the training strategy comes after
    strategy = tf.distribute.MirroredStrategy(devices=list(devices))
    n = len(devices)

    def timed(sizes):
        with strategy.scope():
            variables = [tf.Variable(tf.ones([size])) for size in sizes]

        @tf.function
        def run():
            def replica():
                ctx = tf.distribute.get_replica_context()
                return [t[:1] for t in ctx.all_reduce("sum", [v.read_value() for v in variables])]
            return strategy.run(replica)

        return _typical_time(lambda: [t.numpy() for t in tf.nest.flatten(strategy.experimental_local_results(run()))])

    total = sum(shares)
    small = timed([1] * len(shares))
    large = timed([max(1, round(mib * 2**20 // 4 * share / total)) for share in shares])
    hops = 2 * (n - 1)
    bandwidth = hops / n * mib * 2**20 / max(large - small, 1e-9)
    return bandwidth, small / hops


def _collective_overhead(devices, chain: int = 20, size: int = 128) -> float:
    """Seconds one all-reduce of one value adds to a step on `devices`: a chain of `chain`
    matmuls of size x size on every replica, with an all-reduce after each, against the same
    chain without them (the median of 3 interleaved rounds: a difference of two timings)."""
    import tensorflow as tf

    from tf_multigpu.compat import new_mirrored_collective_keys

    new_mirrored_collective_keys()
    strategy = tf.distribute.MirroredStrategy(devices=list(devices))
    with strategy.scope():
        var = tf.Variable(tf.random.normal([size, size]) * 0.01)

    def timed(with_collectives: bool):
        @tf.function
        def run():
            def replica():
                ctx, x = tf.distribute.get_replica_context(), var.read_value()
                for _ in range(chain):
                    x = tf.matmul(x, var) + 0.5
                    if with_collectives:
                        x = x + ctx.all_reduce("sum", x[:1, :1])
                return x[:1, :1]
            return strategy.run(replica)
        return lambda: [t.numpy() for t in strategy.experimental_local_results(run())]

    runs = [timed(True), timed(False)]
    rounds = [[_typical_time(run) for run in runs] for _ in range(3)]
    return max(statistics.median(with_ - without for with_, without in rounds), 0.0) / chain


def _split_conv_overhead(devices, convs, batch: int = 4) -> tuple[float, float]:
    """(time of our filter-split convolution over tf.nn.conv2d's on `convs`, forward and
    backward, on every device of `devices` at once; the share of ours that does not shrink
    when its filters are split).

    A device of a `model` group builds the patches of its whole (gathered) input, for the
    forward and again for the weight gradient, whatever share of the filters it holds; only
    the contractions and the input gradient's patches of dy scale with its filters. So the
    split convolution is timed with all the filters and with a quarter of them, and its time
    on a device holding 1/M of them is t_all x (replicated + (1 - replicated) / M). All the
    devices run at once, as a mesh's do: on shared cores the skinny contractions of a split
    kernel and the stock convolution do not slow down alike.
    """
    import tensorflow as tf

    from tf_multigpu.parallel.split_conv import split_conv2d

    def make():
        return tuple((tf.random.normal([batch, *shape]), tf.random.normal(kernel) * 0.05)
                     for shape, kernel, *_ in convs)

    def stock(x, w, stride, padding, need_input_grad):
        return tf.nn.conv2d(x, w, stride, padding)

    def timing(conv, filters=1.0):
        def body(*pairs):
            total = tf.constant(0.0)
            for (x, w), (_, _, stride, padding, needs_dx) in zip(pairs, convs):
                w = w[..., :max(1, round(w.shape[-1] * filters))]
                wanted = [x, w] if needs_dx else [w]   # a first layer's step computes no dx
                with tf.GradientTape() as tape:
                    tape.watch(wanted)
                    y = tf.reduce_sum(conv(x, w, stride, padding, need_input_grad=needs_dx))
                total += sum(tf.reduce_sum(g[:1]) for g in tape.gradient(y, wanted))
            return total
        return _concurrent(devices, make, body)

    # Interleaved rounds, and the median of each round's ratios: a difference of two timings
    # (the replicated share) is noisy on shared cores, and so is one round.
    runs = [timing(split_conv2d), timing(split_conv2d, 0.25), timing(stock)]
    rounds = [[_typical_time(run, repeats=2) for run in runs] for _ in range(3)]
    overhead = statistics.median(ours / stock for ours, _, stock in rounds)
    # t(f) = a + b f over the share f of the filters: t(1) = ours, t(1/4) = quarter.
    replicated = statistics.median(min(max(1 - max(ours - quarter, 0.0) * 4 / 3 / ours, 0.0), 1.0)
                                   for ours, quarter, _ in rounds)
    return overhead, replicated


def _memory_per_device(devices) -> float:
    """GPU memory TensorFlow may use on the device; logical CPUs share the host's RAM."""
    if "GPU" in devices[0].upper():
        from tf_multigpu.compat import gpu_memory_limits
        limits = gpu_memory_limits()
        if limits:
            return float(min(limits))
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / len(devices)
