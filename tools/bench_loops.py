"""Loop overhead benchmark: our training loop against what a user would otherwise write.

    python -m tools.bench_loops                       # small_convnet on digits, batch 256
    python -m tools.bench_loops --model=alexnet --dataset=synthetic --image_size=64 --batch_size=64

In ONE process with 4 logical CPU devices, on identical work (same model, seed, global batch,
input pipeline), it times:
  * `--strategy=single` (our `train()`) against a minimal hand-written Keras + `tf.function`
    loop on one device;
  * `--strategy=data` on 2 and 4 devices against Keras `model.fit` under the same
    MirroredStrategy.
Each pair runs `--repeats` times, alternating, and the table gives the median examples/s and
our ratio to the baseline (> 1: we are faster). The baselines leave the first `--warmup` steps
(tracing) untimed and time `--steps`; our loop's examples/s (summary.json's) leaves out its first
window of 10 steps, where it traces, and times the other warmup - 10 + steps: the same rate,
over a few more steps where --warmup > 10. Logical CPUs share the same cores: this measures
overhead, not multi-device speedup.
"""

import statistics
import sys
import tempfile
import time

from absl import flags, logging

from tf_multigpu import cli
from tf_multigpu.config.workload_flags import check_workload_flags, define_workload_flags
from tf_multigpu.errors import UsageError

PROG = "bench_loops"
_WORKLOAD = define_workload_flags(("model", "dataset", "image_size", "batch_size"), batch_size=256)
flags.DEFINE_integer("warmup", 10, "Untimed steps (tracing, warm-up); a multiple of log_every.")
flags.DEFINE_integer("steps", 60, "Timed steps per measurement.")
flags.DEFINE_integer("repeats", 3, "Alternating repetitions of each pair.")
FLAGS = flags.FLAGS
LOG_EVERY = 10


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
    check_workload_flags()
    for name in ("warmup", "steps", "repeats"):
        if FLAGS[name].value < 1:
            raise UsageError(f"--{name}={FLAGS[name].value} must be >= 1")
    logging.set_verbosity(logging.ERROR)   # the timed loops' progress lines would bury the table
    cli.start_tensorflow()
    from tf_multigpu.parallel import configure_devices
    devices = configure_devices(cpu_devices=4)
    import keras
    import tensorflow as tf

    from tf_multigpu.config import Config
    from tf_multigpu.data import load_source
    from tf_multigpu.data.pipeline import train_dataset
    from tf_multigpu.models import build_model
    from tf_multigpu.training.loop import train

    source = load_source(FLAGS.dataset, image_size=FLAGS.image_size)
    total = FLAGS.warmup + FLAGS.steps
    batch = FLAGS.batch_size

    def ours(strategy, n):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Config(run_dir=tmp, strategy=strategy, dataset=FLAGS.dataset, image_size=FLAGS.image_size,
                         model=FLAGS.model, batch_size=batch, steps=total, log_every=LOG_EVERY,
                         eval_every=10 ** 9, checkpoint_every=10 ** 9, lr_schedule="constant",
                         learning_rate=0.01)
            return train(cfg, devices[:n])["examples_per_sec"]

    def data():
        return train_dataset(source, seed=0, global_batch=batch, batch_size=batch)

    def handwritten():
        keras.utils.set_random_seed(0)
        with tf.device(devices[0]):
            model = build_model(FLAGS.model, source.image_shape, source.num_classes)
            opt = keras.optimizers.SGD(0.01, momentum=0.9, weight_decay=5e-4)

            @tf.function
            def step(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                        y, model(x, training=True), from_logits=True))
                opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
                return loss

            it = iter(data())
            for _ in range(FLAGS.warmup):
                loss = step(*next(it))
            loss.numpy()
            t0 = time.perf_counter()
            for _ in range(FLAGS.steps):
                loss = step(*next(it))
            loss.numpy()
            return FLAGS.steps * batch / (time.perf_counter() - t0)

    def keras_fit(n):
        from tf_multigpu.compat import new_mirrored_collective_keys
        new_mirrored_collective_keys()
        strategy = tf.distribute.MirroredStrategy(devices[:n])
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = build_model(FLAGS.model, source.image_shape, source.num_classes)
            model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9, weight_decay=5e-4),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
        marks = {}

        class Timer(keras.callbacks.Callback):
            def on_train_batch_end(self, index, logs=None):
                if index + 1 in (FLAGS.warmup, total):
                    marks[index + 1] = time.perf_counter()

        model.fit(data(), steps_per_epoch=total, epochs=1, verbose=0, callbacks=[Timer()])
        return FLAGS.steps * batch / (marks[total] - marks[FLAGS.warmup])

    pairs = [("single, 1 device", lambda: ours("single", 1), "hand-written tf.function", handwritten)]
    for n in (2, 4):
        pairs.append((f"data, {n} devices", lambda n=n: ours("data", n), f"model.fit, Mirrored x{n}",
                      lambda n=n: keras_fit(n)))
    rows = []
    for name, run_ours, base_name, run_base in pairs:
        a, b = [], []
        for _ in range(FLAGS.repeats):
            a.append(run_ours())
            b.append(run_base())
        rows.append((name, statistics.median(a), base_name, statistics.median(b)))
        print(f"{name}: ours {a}  {base_name} {b}", file=sys.stderr, flush=True)

    print(f"\n{FLAGS.model} on {source.name} {source.image_shape}, global batch {batch}, "
          f"{FLAGS.steps} timed steps after {FLAGS.warmup}, median of {FLAGS.repeats}, logical CPUs\n")
    print("| ours | examples/s | baseline | examples/s | ours / baseline |")
    print("| --- | ---: | --- | ---: | ---: |")
    for name, ours_rate, base_name, base_rate in rows:
        print(f"| {name} | {ours_rate:.0f} | {base_name} | {base_rate:.0f} | {ours_rate / base_rate:.2f} |")


def run():
    """Entry point: `python -m tools.bench_loops`."""
    cli.run(main, PROG, _WORKLOAD)   # the tool's own flags are listed by --help already


if __name__ == "__main__":
    run()
