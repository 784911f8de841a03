"""Input pipeline throughput per source, beside what the training step consumes (issue 15).

    python -m tools.input_throughput --model=alexnet --image_size=224 --batch_size=64
    python -m tools.input_throughput --model=small_convnet --image_size=32 --batch_size=256

For each source it times, in ONE process, the pipeline alone (decode, augment, batch,
preprocess; no model) in images/s, and the training step alone (the same model, global batch,
strategy and devices, fed one constant batch so that input costs nothing) in images/s. The
headroom is their ratio: above 1 the pipeline outruns the step, below 1 the devices wait for
data. Sources: digits (8x8, only for models at that size), synthetic, a folder of JPEGs
(--folder, or one written here: --folder_images JPEGs of --folder_shape pixels, the size of an
average ImageNet photo) and TFDS (--tfds=NAME prepared under --data_dir; without it,
imagenet2012 under `tfds.testing.mock_data`, whose tiny images are generated in Python: that
row measures the mock, not TFDS). On CPUs the pipeline and the step share the same cores.
"""

import os
import sys
import tempfile
import time

from absl import flags, logging

from tf_multigpu import cli
from tf_multigpu.config.config import AUGMENTS
from tf_multigpu.config.workload_flags import check_workload_flags, define_workload_flags
from tf_multigpu.errors import UsageError

PROG = "input_throughput"
_WORKLOAD = define_workload_flags(("model", "image_size", "batch_size", "data_dir"), image_size=32)
flags.DEFINE_string("strategy", "data", "single or data (the step's devices).")
flags.DEFINE_integer("cpu_devices", 2, "Logical CPU devices (0: GPUs).")
flags.DEFINE_list("sources", ["digits", "synthetic", "folder", "tfds"], "Sources to time.")
flags.DEFINE_string("augment", "auto", "--augment for the folder and TFDS sources.")
flags.DEFINE_string("folder", "", "An image folder to time (default: JPEGs written to a temporary folder).")
flags.DEFINE_integer("folder_images", 512, "JPEGs to write when --folder is not given.")
flags.DEFINE_list("folder_shape", ["375", "500"], "Height,width of the written JPEGs.")
flags.DEFINE_string("tfds", "", "A TFDS set prepared under --data_dir (default: mock imagenet2012).")
flags.DEFINE_float("seconds", 5.0, "Seconds to time each pipeline and the step (after warm-up).")
FLAGS = flags.FLAGS


def write_jpegs(root, count, shape, classes=10):
    """`count` JPEGs of `shape` in `classes` class folders: smooth gradients plus noise, so the
    files compress like photos rather than like pure noise."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    h, w = shape
    y, x = np.mgrid[:h, :w]
    for i in range(count):
        base = np.stack([(x * (i % 7 + 1) + y) % 256, (y * (i % 5 + 1)) % 256, (x + y * 2 + i) % 256], -1)
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        folder = os.path.join(root, f"class_{i % classes}")
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(pixels).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)
    return root


def step_images_per_sec(source, devices):
    """What the training step consumes, fed a constant on-device batch: input costs nothing."""
    import tensorflow as tf

    from tf_multigpu.config import Config
    from tf_multigpu.data.pipeline import train_dataset
    from tf_multigpu.training.run import build_run

    cfg = Config(strategy=FLAGS.strategy, model=FLAGS.model, batch_size=FLAGS.batch_size, steps=10 ** 6)
    run = build_run(cfg, devices, source=source)   # a run in memory
    images, labels = next(iter(train_dataset(source, seed=0, global_batch=cfg.batch_size, batch_size=cfg.batch_size)))
    batch = tf.data.Dataset.from_tensors((images, labels)).repeat()
    it = iter(run.par.distribute(lambda b: batch.unbatch().batch(b, drop_remainder=True)))
    step = run.train_fn
    step(it, tf.constant(2))["count"].numpy()                 # tracing, warm-up
    steps, start = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - start < FLAGS.seconds:
        step(it, tf.constant(1))["count"].numpy()
        steps += 1
    return steps * cfg.batch_size / (time.perf_counter() - start)


# Classes of the written folder, and the images each needs for the stratified held-out tenth.
_FOLDER_CLASSES, _PER_CLASS = 10, 10


def check_flags():
    """What the flags alone decide, before TensorFlow starts (UsageError, one line)."""
    check_workload_flags()
    if FLAGS.cpu_devices < 0:
        raise UsageError(f"--cpu_devices={FLAGS.cpu_devices} must be >= 0 (0: GPUs)")
    if FLAGS.seconds <= 0:
        raise UsageError(f"--seconds={FLAGS.seconds} must be > 0, e.g. --seconds=5")
    if FLAGS.augment not in AUGMENTS:
        raise UsageError(f"unknown --augment={FLAGS.augment!r}: choose one of {', '.join(AUGMENTS)}")
    unknown = [s for s in FLAGS.sources if s not in ("digits", "synthetic", "folder", "tfds")]
    if unknown or not FLAGS.sources:
        raise UsageError(f"--sources={','.join(FLAGS.sources)}: choose from digits, synthetic, folder, tfds")
    if "folder" in FLAGS.sources and not FLAGS.folder:
        shape = FLAGS.folder_shape
        if len(shape) != 2 or not all(v.isdigit() and int(v) > 0 for v in shape):
            raise UsageError(f"--folder_shape={','.join(shape)} must be HEIGHT,WIDTH in pixels, e.g. 375,500")
        if FLAGS.folder_images < _FOLDER_CLASSES * _PER_CLASS:
            raise UsageError(f"--folder_images={FLAGS.folder_images}: the written folder needs at least "
                             f"{_FOLDER_CLASSES * _PER_CLASS} ({_PER_CLASS} per class, for its held-out tenth)")
    if FLAGS.sources == ["digits"] and FLAGS.image_size != 8:
        raise UsageError(f"--sources=digits times 8x8 images, not --image_size={FLAGS.image_size}: "
                         "add --image_size=8, or other sources")


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
    if FLAGS.strategy not in ("single", "data"):
        cli.fail(PROG, f"--strategy={FLAGS.strategy}: the input pipeline is timed against a single or data "
                       "parallel step; give --strategy=single or --strategy=data")
    check_flags()
    logging.set_verbosity(logging.ERROR)
    cli.start_tensorflow()
    from tf_multigpu.parallel import configure_devices
    devices = configure_devices(1 if FLAGS.strategy == "single" else 0, FLAGS.cpu_devices)
    import contextlib

    import tensorflow_datasets as tfds

    from tf_multigpu.data import load_source
    from tf_multigpu.data.pipeline import train_dataset
    from tf_multigpu.data.throughput import images_per_sec

    size, batch = FLAGS.image_size, FLAGS.batch_size
    rows, steps = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in FLAGS.sources:
            context = contextlib.nullcontext()
            if name == "digits":
                if size != 8:
                    print(f"skipping digits: its images are 8x8, the model's input {size}x{size}", file=sys.stderr)
                    continue
                source = load_source("digits")
            elif name == "synthetic":
                source = load_source("synthetic", image_size=size)
            elif name == "folder":
                path = FLAGS.folder or write_jpegs(os.path.join(tmp, "jpegs"), FLAGS.folder_images,
                                                   tuple(int(v) for v in FLAGS.folder_shape), _FOLDER_CLASSES)
                source = load_source(f"folder:{path}", image_size=size, augment=FLAGS.augment, test_fraction=0.1)
            elif name == "tfds":
                context = contextlib.nullcontext() if FLAGS.tfds else tfds.testing.mock_data(num_examples=4096)
                context.__enter__()
                source = load_source(f"tfds:{FLAGS.tfds or 'imagenet2012'}", FLAGS.data_dir, size,
                                     augment=FLAGS.augment)
            pipeline = images_per_sec(train_dataset(source, seed=0, global_batch=batch, batch_size=batch),
                                      warmup=3, max_batches=10 ** 6, seconds=FLAGS.seconds)
            shape = tuple(source.image_shape)
            if shape not in steps:
                steps[shape] = step_images_per_sec(source, devices)
            context.__exit__(None, None, None)
            augment = "paper" if source.train_decode else "none"
            label = f"{name}{' (mock)' if name == 'tfds' and not FLAGS.tfds else ''}"
            rows.append((label, shape, augment, pipeline, steps[shape]))
            print(f"{label}: pipeline {pipeline:.0f} images/s, step {steps[shape]:.0f} images/s", file=sys.stderr,
                  flush=True)

    print(f"\n{FLAGS.model}, global batch {batch}, --strategy={FLAGS.strategy} on {len(devices)} device(s) "
          f"({', '.join(sorted(set(d.split(':')[-2] for d in devices)))}), {FLAGS.seconds:.0f} s per figure\n")
    print("| source | input shape | augment | pipeline alone, images/s | step consumes, images/s | headroom |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for label, shape, augment, pipeline, step in rows:
        size = "x".join(map(str, shape))
        print(f"| {label} | {size} | {augment} | {pipeline:.0f} | {step:.0f} | {pipeline / step:.2f} |")


def run():
    """Entry point: `python -m tools.input_throughput`."""
    cli.run(main, PROG, _WORKLOAD)


if __name__ == "__main__":
    run()
