"""Runs ONE BenchRun in this process and prints its result as one JSON line.

    python -m tools.bench.worker '<BenchRun as JSON>' '{"image_shape": [H, W, C], "num_classes": K}'

runner.py starts one of these per configuration: logical devices must be configured before
TensorFlow starts, and a second DTensor mesh in one process can hang (BUILD_NOTES.md).

Every kind does identical work: the same model factory, global batch, devices and SGD with
momentum, fed from a small pool of ready batches in memory (POOL_BATCHES), so the timing is
the training step and not input decoding, which on a CPU would compete with the step for the
same cores. The first `warmup_steps` (tracing, allocation) are not timed; then each step is
timed on its own, from dispatch until its result is on the host, so steps are comparable
across kinds: our compiled step runs one step per call and we read its sums back; Keras
`fit` runs with steps_per_execution=1 and a batch callback (which makes Keras convert the
logs to Python values, i.e. wait for the step); PyTorch waits by construction on CPU and
with cuda.synchronize on GPU.

Thread budget (CPU): TensorFlow gets intra-op = inter-op = `threads` for the whole process,
shared by all its logical devices; PyTorch's N processes get threads // N each (at least
one), so both use the same cores. This file imports TensorFlow only inside functions so that
PyTorch's spawned processes, which re-import it, stay free of TensorFlow.
"""

import json
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

POOL_BATCHES = 2
TRACED_STEPS = 3   # after the timed steps: traced for the compute / communication split


def main(argv) -> int:
    from tools.bench.configs import BenchRun
    run = BenchRun.from_json(argv[1])
    try:
        if run.kind == "torch_ddp":
            from tools.bench.torch_peer import run_torch_ddp
            data = json.loads(argv[2])   # from the sweep: this process never imports TensorFlow
            result = run_torch_ddp(run, tuple(data["image_shape"]), data["num_classes"])
        else:
            result = _run_tensorflow(run)
    except Exception as e:   # reported as the row's error; the sweep goes on
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    print(json.dumps(result), flush=True)
    return 0


def _run_tensorflow(run) -> dict:
    import tensorflow as tf

    from tf_multigpu.parallel import configure_devices
    threads = run.threads or os.cpu_count()
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    gpus = tf.config.list_physical_devices("GPU")
    devices = configure_devices(run.devices, run.cpu_devices or (0 if gpus else run.devices))
    device_kind = "GPU" if "GPU" in devices[0].upper() else "CPU"
    if run.kind == "ours":
        out = _time_ours(run, devices)
    else:
        out = _time_keras_fit(run, devices)
    return {**out, "device_kind": device_kind, "threads": threads}


def _source_and_batches(run, global_batch, batch_size):
    """The data source and a dataset cycling POOL_BATCHES ready batches of `batch_size`."""
    from tf_multigpu.data import load_source
    from tf_multigpu.data.pipeline import train_dataset
    source = load_source(run.dataset, image_size=run.image_size)

    def make(b=batch_size):
        per_step = global_batch // b
        ds = train_dataset(source, seed=run.seed, global_batch=global_batch, batch_size=b)
        return ds.take(POOL_BATCHES * per_step).cache().repeat()

    return source, make


def _time_ours(run, devices) -> dict:
    """Our training step, built as the training loop builds it (build_run, a run in memory)."""
    import tensorflow as tf

    from tf_multigpu.config import Config
    from tf_multigpu.training.run import build_run

    cfg = Config(strategy=run.strategy, model=run.model, dataset=run.dataset, image_size=run.image_size,
                 batch_size=run.batch, steps=run.warmup_steps + run.timed_steps, lr_schedule="constant",
                 learning_rate=0.01, seed=run.seed, dtype=run.dtype, xla=run.xla, mesh=run.mesh)
    source, make = _source_and_batches(run, run.batch, run.batch)
    built = build_run(cfg, devices, source=source)
    iterator = iter(built.par.distribute(make))
    one = tf.constant(1)

    def step():
        return {k: v.numpy() for k, v in built.train_fn(iterator, one).items()}

    times = _time_steps(step, run.warmup_steps, run.timed_steps)
    return {"step_times_s": times, "memory_bytes": built.memory, "parameters": int(built.model.count_params()),
            **_traced_split(step)}


def _traced_split(step, steps: int = TRACED_STEPS) -> dict:
    """Median step and communication seconds of `steps` extra steps traced by the profiler
    (the communication report's reading of the trace: tf_multigpu/profiling/xspace.py)."""
    import statistics
    import tempfile

    import tensorflow as tf

    from tf_multigpu.compat import profiler_step
    from tf_multigpu.profiling import xspace
    with tempfile.TemporaryDirectory() as logdir:
        tf.test.experimental.sync_devices()   # the untraced steps' last ops are not the trace's
        tf.profiler.experimental.start(logdir)
        for n in range(steps):
            with profiler_step(n + 1):
                step()
                tf.test.experimental.sync_devices()   # the whole step inside its marker (a mesh runs async)
        tf.profiler.experimental.stop()
        per_step = xspace.step_times(xspace.latest_trace(logdir))
    if not per_step:
        return {}
    return {"traced_step_s": statistics.median(s["step_ms"] for s in per_step) / 1e3,
            "traced_communication_s": statistics.median(s["communication_ms"] for s in per_step) / 1e3}


def _time_keras_fit(run, devices) -> dict:
    """Keras `model.fit` under the same tf.distribute strategy as our `single`/`data`."""
    import keras

    from tf_multigpu.models import build_model
    from tf_multigpu.parallel import make_parallelism

    par = make_parallelism("single" if run.devices == 1 else "data", devices, run.batch)
    source, make = _source_and_batches(run, run.batch, run.batch)   # fit splits global batches
    keras.utils.set_random_seed(run.seed)
    if run.dtype != "float32":
        keras.config.set_dtype_policy(f"mixed_{run.dtype}")
    with par.strategy.scope():
        model = build_model(run.model, source.image_shape, source.num_classes)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9, weight_decay=5e-4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=1, jit_compile=run.xla)
    times = []

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            # Keras hands this callback the logs as Python numbers: the step has finished.
            times.append(time.perf_counter() - self.start)

    model.fit(make(), steps_per_epoch=run.warmup_steps + run.timed_steps, epochs=1, verbose=0,
              callbacks=[StepTimer()])
    return {"step_times_s": times[run.warmup_steps:], "parameters": int(model.count_params())}


def _time_steps(step, warmup: int, timed: int) -> list:
    """Seconds of each of `timed` calls of `step` after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(timed):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


if __name__ == "__main__":
    sys.exit(main(sys.argv))
