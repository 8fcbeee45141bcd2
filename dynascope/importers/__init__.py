"""Importers: bring external data (profiler traces, checkpoints, wandb runs) into a run."""
