"""A writer process to kill: each flush of 20 scalars rows goes to its journal (no seal for an hour), and
it prints the step once that flush returned."""

KEYS = 20
SCRIPT = """
import sys
from dynascope.store import RunWriter
w = RunWriter(sys.argv[1], flush_secs=0.5, seal_secs=3600)
for i in range(10_000):
    w.append("scalars", {"step": i, "key": [f"m{k}" for k in range(20)], "value": [float(i)] * 20})
    w.flush()
    print(i, flush=True)
"""
