"""Profiling inter-device communication: a TensorBoard trace of chosen steps, and a report of
how long each step spent communicating and how many bytes each device moved, by kind, next to
the analytic minimum for the strategy; and the memory a run measures beside its estimate.

- `collectives`: the collectives one training step runs, read from TensorFlow's own graphs
  (the traced function for tf.distribute; the SPMD-expanded graph for DTensor).
- `xspace`: step and collective timings read from the profiler's XSpace protobuf.
- `analytic`: the bytes a strategy must move at least, from the model and its layout.
- `report`: the table (JSON, Markdown, TensorBoard scalars).
- `step_profiler`: what the training loop calls around the profiled steps.
- `memory_measured`: the measured peaks (the GPU allocator's, or the process's peak RSS on
  logical CPUs) that summary.json sets beside the estimate; `xspace.allocations_at_peak`
  reads what the allocator held at its peak from a trace.
"""
