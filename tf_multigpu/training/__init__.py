"""Training: the step (what one update computes), the run (`run.build_run`: everything a step
needs), the cadence (when things happen) and the loop (`loop.train`: build, loop, finish)."""
