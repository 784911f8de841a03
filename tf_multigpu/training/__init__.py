"""Training: the step (what one update computes) and the loop (when things happen)."""
