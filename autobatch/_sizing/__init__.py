"""Sizing: the step and its setup, trials, saved state, and the front-ends that find, predict,
time and tabulate batch sizes (the finder, the search per length, the planner, throughput)."""
