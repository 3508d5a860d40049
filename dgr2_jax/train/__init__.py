"""Training core: config defaults, mesh/shardings, optimiser, checkpoints, metrics, the loop, losses."""
