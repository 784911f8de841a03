"""What the training loop calls to profile steps A..B of a run (`--profile_steps=A,B`).

Profiled steps run one per call, each inside a `tf.profiler.experimental.Trace` step marker,
so TensorBoard's profile plugin shows them as steps; the other steps run as usual. The step
computation is the same compiled function either way, so profiling does not change results.
The collectives of one step are read from TensorFlow's graphs at the first call.
"""

from __future__ import annotations

import tensorflow as tf
from absl import logging

from tf_multigpu.compat import profiler_step
from tf_multigpu.parallel.base import host_scalars
from tf_multigpu.profiling import analytic, report, xspace
from tf_multigpu.profiling import collectives as coll


class StepProfiler:
    """Traces steps first..last (counted from 1) into `logdir` and writes the report."""

    def __init__(self, profile_range: tuple, logdir: str, report_prefix: str, par, model, meta: dict):
        self.first, self.last = profile_range   # --profile_steps, parsed by the config
        self.logdir, self.report_prefix = logdir, report_prefix
        self.par, self.model, self.meta = par, model, meta
        self.collectives = None
        self.report = None

    def profiles(self, step: int) -> bool:
        """Whether the step after `step` (i.e. step + 1) is traced."""
        return self.first <= step + 1 <= self.last

    def window(self, step: int, window: int) -> int:
        """`window` cut so that traced steps run alone and tracing starts on time."""
        if step + 1 < self.first:
            return min(window, self.first - 1 - step)
        return 1 if self.profiles(step) else window

    def run(self, train_fn, iterator, step: int, window: int) -> dict:
        """`train_fn(iterator, window)`, traced if it is a profiled step; the sums as floats."""
        sums = self._run(train_fn, iterator, step, window)
        if self.collectives is not None:
            return sums
        # That was the first call, which compiled the step: read its collectives from TensorFlow's graphs.
        if self.par.spmd_lowered:   # DTensor: collectives exist only after SPMD expansion
            found = coll.read_lowered_step(self.meta["global_batch"],
                                           {tuple(w.shape) for w in self.model.weights})
            if found is None:
                logging.warning("communication report: the DTensor step's graph was not dumped (graph dumps "
                                "must be enabled before TensorFlow starts, as tf-multigpu-train does): bytes "
                                "are not counted")
                found = []
        else:
            graph = train_fn.one_step.get_concrete_function(iterator).graph
            found = coll.from_function_graph(graph, self.par.devices[0], self.par.all_reduce == "one_device")
        self.collectives = found
        return sums

    def _run(self, train_fn, iterator, step, window):
        if not self.profiles(step):
            return host_scalars(train_fn(iterator, tf.constant(window)))
        if step + 1 == self.first:
            tf.test.experimental.sync_devices()   # the previous step's last ops are not this trace's
            tf.profiler.experimental.start(self.logdir)
        with profiler_step(step + 1):
            sums = host_scalars(train_fn(iterator, tf.constant(1)))   # inside the marker: wait for the step,
            # all of it: a mesh's devices run asynchronously, and the loss reaches the host before
            # the update's ops have run (a trace stopped then misses them: tests/test_split_layers.py).
            tf.test.experimental.sync_devices()
        if step + 1 == self.last:
            tf.profiler.experimental.stop()
        return sums

    def finish(self, writer, step: int) -> dict | None:
        """After the last profiled step: builds and writes the report (None if not reached)."""
        if self.report is not None or step < self.last:
            return self.report
        minimum = analytic.minimum_bytes(self.par.plan, self.par.global_batch)
        self.report = report.build(self.meta, self.collectives or [], minimum, xspace.latest_trace(self.logdir))
        report.write(self.report, self.report_prefix, writer, step)
        return self.report
