"""Runs one mesh's parity checks in its own process and prints them as JSON.

    python -m tests.parity_worker STRATEGY MESH LAYOUT[,LAYOUT...] [STEPS] [dtype=D] [xla=1]
                                  [model=FACTORY image_size=S batch=B] [float64=1] [shard=1]
                                  [overrides=REGEX=SPEC;...]
                                  [-- STRATEGY MESH LAYOUT... (another job on the same devices)]

With dtype=D both runs compute in D; with xla=1 the parallel run is XLA-compiled and the
reference is not. With model=FACTORY (e.g. tests.user_models:resnet50) the model is a user's
factory on synthetic S x S images, global batch B; the result then also holds the noise floor
of the measure for that model: one device's step on the same batch with its rows permuted
(BatchNormalization's batch sums in another order). With float64=1 both runs compute in
float64, where reordering costs ~1e-16 and any remaining difference is a real one. With shard=1
the parallel runs shard their optimizer state over `batch` (--shard_optimizer_state), and the
result also holds the momentum values one device keeps per trainable value it keeps.

A second DTensor mesh over other devices in the same process can hang in collective set-up
(BUILD_NOTES.md), so tests/test_parity.py starts one process per mesh; jobs separated by `--`
must use the same devices (and the same float64 setting: it is the process's Keras default),
and print a JSON list of their results, in order. TensorFlow's start-up is most of a small
job's time, so the suite runs each mesh's float32 jobs in one process.
"""

import json
import sys

import numpy as np
import tensorflow as tf

from tests.conftest import DEVICES
from tests.helpers import load_digits_batch, max_update_difference, one_step, statistics_difference
from tf_multigpu.config import Config
from tf_multigpu.data import load_source
from tf_multigpu.training.run import build_run


def main(*argv):
    jobs, job = [], []
    for arg in argv:
        if arg == "--":
            jobs.append(job)
            job = []
        else:
            job.append(arg)
    jobs.append(job)
    if len(jobs) == 1:
        print(json.dumps(run_job(*jobs[0])))
        return
    meshes = {tuple(j[1:2]) for j in jobs}
    float64 = {"float64=1" in j for j in jobs}
    if len(meshes) > 1 or len(float64) > 1:
        sys.exit(f"jobs in one process need one mesh and one float64 setting, not {jobs}")
    print(json.dumps([run_job(*j) for j in jobs]))


def run_job(strategy, mesh, layouts, steps="1", *options):
    """One job's result (a dict by layout, and the extras its options ask for)."""
    options = dict(option.split("=", 1) for option in options)
    dtype, xla = options.get("dtype", "float32"), options.get("xla") == "1"
    shard = {"shard_optimizer_state": True} if options.get("shard") == "1" else {}
    # --layout_overrides (REGEX=SPEC;...), on the parallel run only
    overrides = {"layout_overrides": options["overrides"]} if "overrides" in options else {}
    model = options.get("model", "small_convnet")
    if options.get("float64") == "1":   # both runs: rounding ~1e-16, so only a real difference shows
        import keras
        keras.config.set_floatx("float64")
        keras.config.set_dtype_policy("float64")
    if "image_size" in options:
        source = load_source("synthetic", image_size=int(options["image_size"]))
        records = source.train_records().map(lambda i, label: (source.preprocess(source.decode(i)), label))
        images, labels = next(iter(records.batch(int(options.get("batch", 8)))))
    else:
        source, images, labels = load_digits_batch()
    before, single = one_step("single", DEVICES, source, images, labels, steps=int(steps), dtype=dtype, model=model)
    size = eval(mesh.replace("batch:", "").replace(",model:", "*"))
    result = {}
    for layout in layouts.split(","):
        before_m, split = one_step(strategy, DEVICES[:size], source, images, labels, steps=int(steps),
                                   mesh=mesh, layout=layout, dtype=dtype, xla=xla, model=model, **shard, **overrides)
        result[layout] = {
            "same_initial_weights": all((a == b).all() for a, b in zip(before, before_m)),
            "max_update_difference": max_update_difference(before, split, single),
            "statistics_difference": statistics_difference(before, split, single),
        }
    if shard:   # what the momentum buffers hold per device, against the weights they update
        run = build_run(Config(strategy=strategy, model=model, batch_size=len(labels), mesh=mesh,
                               layout=layouts.split(",")[0], **shard), DEVICES[:size], source=source)
        slots = sum(np.prod(run.par.local_shape(v)) for v in run.optimizer.momentums)
        weights = sum(np.prod(run.par.local_shape(v)) for v in run.model.trainable_variables)
        result["slot_to_weight_elems_per_device"] = float(slots / weights)
    if "model" in options:
        rows = np.random.RandomState(0).permutation(len(labels))
        _, permuted = one_step("single", DEVICES, source, tf.gather(images, rows), tf.gather(labels, rows),
                               steps=int(steps), dtype=dtype, model=model)
        result["noise_floor"] = max_update_difference(before, permuted, single)
    return result


if __name__ == "__main__":
    main(*sys.argv[1:])
