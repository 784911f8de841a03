"""How fast the input pipeline alone makes images, and whether training outruns it.

`images_per_sec` times a dataset by itself (no model), after a warm-up that fills tf.data's
buffers and autotuner. `InputCheck` does that once, between two training windows, for the
rows this process reads, and compares it with what the first timed window consumed: if the pipeline
alone is barely faster than the training, the devices are (or soon will be) waiting for data,
and the log says so once. tools/input_throughput.py makes the same comparison per source.
"""

from __future__ import annotations

import functools
import time

import tensorflow as tf

HEADROOM = 1.25   # below this ratio of pipeline-alone to consumed images/s, input is the limit


def images_per_sec(dataset: tf.data.Dataset, *, warmup: int = 2, min_batches: int = 3,
                   max_batches: int = 50, seconds: float = 1.0) -> float:
    """Images/s that `dataset` (batches whose first element is images) yields by itself.

    Times at least `min_batches` after `warmup` ones, until `seconds` have passed or
    `max_batches` were read."""
    it = iter(dataset)
    for _ in range(warmup):
        next(it)
    images, batches, start = 0, 0, time.perf_counter()
    while batches < min_batches or (batches < max_batches and time.perf_counter() - start < seconds):
        images += int(tf.shape(next(it)[0])[0])
        batches += 1
    return images / (time.perf_counter() - start)


class InputCheck:
    """Measures the pipeline once (`dataset_fn()`: this process's training batches), then
    `verdict(examples_per_sec)` returns one line if training consumes nearly all it makes.

    The pipeline is timed when the first verdict is asked for, between two training windows
    (the training's own input then waits with its buffers full), not when the check is made:
    a run that ends within its first window (--steps=0, a resumed run that is done, a short
    profiled run) gets no verdict, and so spends no second or two timing its input."""

    def __init__(self, dataset_fn, share: float = 1.0):
        self.dataset_fn = dataset_fn
        self.share = share      # of the global batch this process reads (one worker of n: 1/n)
        self.said = False

    @functools.cached_property
    def rate(self) -> float:
        """Images/s the pipeline makes alone (timed on first use)."""
        return images_per_sec(self.dataset_fn())

    def verdict(self, examples_per_sec: float) -> str | None:
        """The log line, the first time training is found input-bound; None otherwise."""
        consumed = examples_per_sec * self.share
        if self.said or not consumed or self.rate / consumed >= HEADROOM:
            return None
        self.said = True
        return (f"input cannot keep up: the pipeline alone makes {self.rate:.0f} images/s, training consumes "
                f"{consumed:.0f} ({self.rate / consumed:.2f}x headroom, under {HEADROOM}x): the devices wait for "
                "data; see README, 'Input throughput', for giving tf.data more CPU")
