"""A 64-rank synthetic cluster run with planted faults (``dynascope.demo.synthetic``) and the planted truth.

``planted_cluster(root)`` writes the run once per ``root`` through the real RunWriter (64 FSDP trainer ranks on
8 nodes, 16 rollout workers on 2 more, a 2-layer model so a record is ~20 rows a rank) and returns it with
its truth: ``truth["planted"]`` names the slow rank, the slow node (host and ranks), the rank slow every 4th
step and the rollout worker with the long tail, with the phases and factors a correct analysis recovers;
``truth["hosts"]`` maps each host to its ranks, ``truth["healthy_spread"]`` bounds how much healthy ranks differ.
"""

from __future__ import annotations

from pathlib import Path

from dynascope.demo.synthetic import ClusterSpec
from dynascope.demo.synthetic_write import read_planted, write_cluster_run

SPEC = ClusterSpec(ranks=64, steps=16, layers=2, tensor_every=8, checkpoint_every=8, samples_per_worker=16)


def planted_cluster(root: Path, spec: ClusterSpec = SPEC, processes: int = 2) -> tuple[Path, dict]:
    """The run under ``root`` (written on the first call) and its planted truth."""
    run = root / f"cluster-{spec.ranks}x{spec.steps}"
    if not (run / "planted.json").exists():
        write_cluster_run(run, spec, processes=processes)
    return run, read_planted(run)
