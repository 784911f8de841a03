"""What replica-independent Dropout and synchronised BatchNorm cost, as step-time ratios.

    python -m tools.bench.replica_consistency [--devices=2] [--rounds=11] [--steps=20]

In one process on logical CPUs, for each pair (A, B) it times compiled windows of `--steps`
training steps of A and B alternately (so both see the same machine load) and prints the
median of the per-round time ratios A/B:
  - small_convnet on digits: StatelessDropout vs Keras' stock Dropout (data x N and single);
  - one dropout layer alone, forward and backward, StatelessDropout vs Dropout;
  - tests.user_models:small_resnet_bn on digits: --batchnorm=sync vs per_replica (data x N).
Logical CPU devices share the cores, so the ratios say how much work is added, not what a GPU
would see.
"""

import statistics
import time

from absl import flags

from tf_multigpu import cli

flags.DEFINE_integer("devices", 2, "logical CPU devices (data-parallel replicas)")
flags.DEFINE_integer("rounds", 11, "alternating timed windows per configuration")
flags.DEFINE_integer("steps", 20, "training steps per timed window")
FLAGS = flags.FLAGS


def _runner(strategy, devices, model, stock_dropout=False, batchnorm="sync"):
    """A function running `steps` training steps of one configuration (already compiled).

    Built by hand, not by build_run: the stock-dropout variant replaces the parallelism's
    build_model, which build_run does not let a caller do."""
    import tensorflow as tf

    from tf_multigpu.config import Config
    from tf_multigpu.data import load_source
    from tf_multigpu.data.pipeline import train_dataset
    from tf_multigpu.parallel import make_parallelism
    from tf_multigpu.training.run import build_model_and_optimizer
    from tf_multigpu.training.step import make_train_step

    source = load_source("digits")
    cfg = Config(strategy=strategy, model=model, batch_size=64, batchnorm=batchnorm)   # no run directory
    par = make_parallelism(strategy, devices, 64, batchnorm=batchnorm)
    if stock_dropout:   # Keras' own layers: build in the scope without build_model's swap
        par.build_model = lambda make: _in_scope(par, make)
    model_, optimizer = build_model_and_optimizer(cfg, par, source, 10_000)
    it = iter(par.distribute(lambda b: train_dataset(source, seed=0, global_batch=64, batch_size=b).repeat()))
    fn = par.compile(make_train_step(model_, optimizer, 64))
    for _ in range(2):   # compile, then one window to warm the caches and thread pools
        fn(it, tf.constant(FLAGS.steps))["count"].numpy()
    return lambda: fn(it, tf.constant(FLAGS.steps))["count"].numpy()


def _layer_runner(layer, shape):
    """Forward and backward of one dropout layer on a [rows, features] activation, 50 times."""
    import tensorflow as tf
    x = tf.random.normal(shape)

    @tf.function
    def run():
        total = tf.constant(0.0)
        for _ in tf.range(50):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.reduce_sum(layer(x, training=True))
            total += tf.reduce_sum(tape.gradient(y, x)) + y
        return total

    run()
    return lambda: run().numpy()


def _in_scope(par, make):
    with par.scope():
        return make()


def _ratio(name, a, b):
    ratios = []
    for _ in range(FLAGS.rounds):
        times = []
        for run in (a, b):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        ratios.append(times[0] / times[1])
    print(f"{name}: median ratio {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}; last window {times[1] / FLAGS.steps * 1e3:.1f} ms/step "
          "for the baseline)", flush=True)


def main(argv):
    if len(argv) > 1:
        cli.fail("replica_consistency", f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
    tf = cli.start_tensorflow()   # run from the repository (python -m): tests.user_models imports
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * FLAGS.devices)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    n = FLAGS.devices
    _ratio(f"small_convnet data x{n}: stateless / stock Dropout",
           _runner("data", devices, "small_convnet"), _runner("data", devices, "small_convnet", stock_dropout=True))
    _ratio("small_convnet single: stateless / stock Dropout",
           _runner("single", devices[:1], "small_convnet"),
           _runner("single", devices[:1], "small_convnet", stock_dropout=True))
    import keras

    from tf_multigpu.parallel.stateless_dropout import StatelessDropout
    for shape in ([64, 256], [256, 9216]):   # small_convnet's drop1; AlexNet's drop6 at batch 256
        stateless = StatelessDropout(0.5, seed=1, name="drop")
        stateless.use_step(tf.Variable(0, dtype=tf.int64))
        _ratio(f"one dropout layer {shape}, fwd+bwd: stateless / stock",
               _layer_runner(stateless, shape), _layer_runner(keras.layers.Dropout(0.5, seed=1), shape))
    bn = "tests.user_models:small_resnet_bn"
    _ratio(f"small_resnet_bn data x{n}: sync / per_replica BatchNorm",
           _runner("data", devices, bn), _runner("data", devices, bn, batchnorm="per_replica"))


if __name__ == "__main__":
    cli.run(main, "replica_consistency")
