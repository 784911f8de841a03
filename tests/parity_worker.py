"""Runs one mesh's parity checks in its own process and prints them as JSON.

    python -m tests.parity_worker STRATEGY MESH LAYOUT[,LAYOUT...] [STEPS] [dtype=D] [xla=1]

With dtype=D both runs compute in D; with xla=1 the parallel run is XLA-compiled and the
reference is not.

A second DTensor mesh over other devices in the same process can hang in collective set-up
(BUILD_NOTES.md), so tests/test_parity.py starts one process per mesh.
"""

import json
import sys

from tests.conftest import DEVICES
from tests.helpers import max_update_difference, one_step
from tf_multigpu.data import load_source


def main(strategy, mesh, layouts, steps="1", *options):
    options = dict(option.split("=") for option in options)
    dtype, xla = options.get("dtype", "float32"), options.get("xla") == "1"
    source = load_source("digits")
    images, labels = next(iter(source.train_records().batch(64)))
    images = source.preprocess(images)
    before, single = one_step("single", DEVICES, source, images, labels, steps=int(steps), dtype=dtype)
    size = eval(mesh.replace("batch:", "").replace(",model:", "*"))
    result = {}
    for layout in layouts.split(","):
        before_m, split = one_step(strategy, DEVICES[:size], source, images, labels, steps=int(steps),
                                   mesh=mesh, layout=layout, dtype=dtype, xla=xla)
        result[layout] = {
            "same_initial_weights": all((a == b).all() for a, b in zip(before, before_m)),
            "max_update_difference": max_update_difference(before, split, single),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
