"""``tensor_stats_global``: one row per (run, role, stage, step, tensor), the whole tensor's statistics, and the only
place readers pool ``tensor_stats`` across ranks.

Stored through the real writer, a tensor is laid out as each setup lays it: FSDP2 shards, HSDP's shards with
a second replica group, a DDP copy on every rank, and a rank restarted from a checkpoint that records two
steps again. The view must give the statistics of the full tensor, computed here by torch from the full
values, and the restart must be recognised (one warning, a ``restart`` event) with the replayed steps
taken from the newer process. A static check then holds every reader outside the store to the view.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

import dynascope
from dynascope.store import RunWriter

from helpers.canonical_rows import stats_row as _row
from helpers.canonical_rows import weights as _weights

PACKAGE = Path(__file__).resolve().parents[1] / "dynascope"


def _truth(new: torch.Tensor, old: torch.Tensor, ref: torch.Tensor) -> dict:
    return {"numel": new.numel(), "w_norm": float(new.norm()), "update_norm": float((new - old).norm()),
            "update_ratio": float((new - old).norm() / new.norm()), "drift_norm": float((new - ref).norm()),
            "drift_ratio": float((new - ref).norm() / ref.norm()),
            "changed_count": int((new != old).sum()), "changed_frac": float((new != old).double().mean())}


def _write(run: Path, rank: int, rows: list[tuple[int, dict]]) -> None:
    with RunWriter(run, rank=rank, world_size=4) as w:
        for step, row in rows:
            w.append("tensor_stats", {"step": step, "stage": "rl", **row})


def _layouts(step: int) -> dict[int, list[tuple[int, dict]]]:
    """Per rank, its rows of ``step``: FSDP2 halves of "fsdp", HSDP (2 replicas × 2 shards) of "hsdp",
    DDP copies of "ddp" on ranks 0 and 1."""
    out: dict[int, list[tuple[int, dict]]] = {r: [] for r in range(4)}
    new, old, ref = _weights(step)
    for r, (a, b) in enumerate([(0, 3), (3, 8)]):
        out[r].append((step, _row("fsdp", new[a:b], old[a:b], ref[a:b], sharded=True, mesh="2", shard=str(r), replica=0)))
    for r in range(4):  # mesh rank = replica * 2 + shard
        a, b = [(0, 4), (4, 8)][r % 2]
        out[r].append((step, _row("hsdp", new[a:b], old[a:b], ref[a:b], sharded=True, mesh="2x2", shard=str(r % 2),
                                  replica=r // 2)))
    for r in (0, 1):
        out[r].append((step, _row("ddp", new, old, ref, sharded=False)))
    return out


def _check(row: dict, want: dict) -> None:
    for col, v in want.items():
        if isinstance(v, float):
            assert row[col] == pytest.approx(v, rel=1e-9), col
        else:
            assert row[col] == v, col


def test_shards_replicas_and_copies_pool_to_the_full_tensor(tmp_path: Path) -> None:
    run = tmp_path / "layouts"
    per_rank: dict[int, list] = {r: [] for r in range(4)}
    for step in (0, 1, 2):
        for r, rows in _layouts(step).items():
            per_rank[r] += rows
    for r, rows in per_rank.items():
        _write(run, r, rows)
    with dynascope.open_store(run) as con:
        got = {(d["step"], d["tensor"]): d for d in con.frame("SELECT * FROM tensor_stats_global").to_dicts()}
        assert con.rows("SELECT count(*) FROM tensor_stats") == [(3 * (2 + 4 + 2),)]
    assert len(got) == 3 * 3  # one row per step and tensor, whatever the layout
    for step in (0, 1, 2):
        want = _truth(*_weights(step))
        for tensor, shards in (("fsdp", 2), ("hsdp", 2), ("ddp", 1)):
            _check(got[step, tensor], want)
            assert got[step, tensor]["shards"] == shards, tensor


def test_a_restarted_rank_replays_steps_and_the_newer_process_counts(tmp_path: Path) -> None:
    """Rank 0 recorded steps 0–3 and crashed; the job resumed from the step-2 checkpoint on new weights
    (another seed), so steps 2 and 3 exist twice with different values."""
    run = tmp_path / "resumed"
    first = [(s, _row("w", *_weights(s), sharded=False)) for s in range(4)]
    _write(run, 0, first)
    again = [(s, _row("w", *_weights(100 + s), sharded=False)) for s in (2, 3, 4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _write(run, 0, again)
    said = [str(w.message) for w in caught if "restart" in str(w.message)]
    assert len(said) == 1 and "rank 0 (trainer)" in said[0], [str(w.message) for w in caught]
    with dynascope.open_store(run) as con:
        got = {d["step"]: d for d in con.frame("SELECT * FROM tensor_stats_global").to_dicts()}
        events = con.frame("SELECT * FROM events WHERE event = 'restart'").to_dicts()
        gens = con.rows("SELECT step, count(DISTINCT generation) FROM tensor_stats GROUP BY step ORDER BY step")
    assert sorted(got) == [0, 1, 2, 3, 4]
    for s in (0, 1):
        _check(got[s], _truth(*_weights(s)))
    for s in (2, 3, 4):
        _check(got[s], _truth(*_weights(100 + s)))  # the replayed steps: the newer process's values
    assert [n for _, n in gens] == [1, 1, 2, 2, 1]
    assert len(events) == 1 and json.loads(events[0]["fields_json"])["processes"] == 1
    # A third process of the same rank is a second restart, and says so.
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _write(run, 0, [(5, _row("w", *_weights(5), sharded=False))])
    with dynascope.open_store(run) as con:
        assert con.rows("SELECT count(*) FROM events WHERE event = 'restart'") == [(2,)]
        assert con.rows("SELECT count(*) FROM tensor_stats_global") == [(6,)]


def test_other_ranks_of_one_launch_are_not_restarts(tmp_path: Path) -> None:
    run = tmp_path / "launch"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for r, rows in _layouts(0).items():
            _write(run, r, rows)
    assert not [w for w in caught if "restart" in str(w.message)]
    with dynascope.open_store(run) as con:
        assert con.rows("SELECT count(*) FROM events WHERE event = 'restart'") == [(0,)]


# --- no reader pools tensor_stats by hand -------------------------------------------------------------------

# The store builds the view and its rollups; probes and importers write rows. Everything else reads.
_WRITERS = ("store", "stats", "probes", "importers")
_RAW = re.compile(r"\b(?:FROM|JOIN)\s+(?:\{q\('tensor_stats'\)\}|\"?tensor_stats\"?)(?![_\w])", re.IGNORECASE)
_POOL = re.compile(r"\b(?:sum|avg|sqrt|median|quantile\w*)\s*\(", re.IGNORECASE)
_PER_RANK = re.compile(r"\b(?:GROUP\s+BY|PARTITION\s+BY)\b[^;]*?\brank\b", re.IGNORECASE | re.DOTALL)
_VOCABULARY = re.compile(r"\b(?:counted_sql|COUNTED_SHARD_SQL|NOT_A_REPLICA_SQL|combine_shards|min_by\(\w+, rank\))")


def _sql_texts(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string literal and f-string of a module, f-string fields as ``{…}`` (the SQL as written)."""
    out = []
    inside = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if id(node) in inside:  # a piece of an f-string, read whole with it
            continue
        if isinstance(node, ast.JoinedStr):
            parts = [v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}" for v in node.values]
            out.append((node.lineno, "".join(str(p) for p in parts)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value))
    return out


def hand_pooling(source: str) -> list[str]:
    """Where ``source`` aggregates raw ``tensor_stats`` rows across ranks, or uses the pooling rule's parts."""
    found = []
    for line, text in _sql_texts(ast.parse(source)):
        if _RAW.search(text) and _POOL.search(text) and not _PER_RANK.search(text):
            found.append(f"line {line}: aggregates tensor_stats across ranks: {' '.join(text.split())[:120]}")
    found += [f"line {i}: uses {m.group(0)}" for i, text in enumerate(source.splitlines(), 1)
              if (m := _VOCABULARY.search(text))]
    return found


def test_the_check_finds_hand_pooling() -> None:
    """The check itself: each way a reader could pool by hand is caught, and per-rank queries are not."""
    assert hand_pooling('q = "SELECT step, sum(numel) FROM tensor_stats GROUP BY step"')
    assert hand_pooling('q = f"SELECT sqrt(sum(w_norm * w_norm)) FROM {q(\'tensor_stats\')} WHERE x"')
    assert hand_pooling("from dynascope.store.pooling import counted_sql")
    assert not hand_pooling('q = "SELECT step, rank, sum(grad_nan_count) FROM tensor_stats GROUP BY step, rank"')
    assert not hand_pooling('q = "SELECT step, sum(numel) FROM tensor_stats_global GROUP BY step"')
    assert not hand_pooling('q = "SELECT DISTINCT stage FROM tensor_stats"')


def test_no_reader_pools_tensor_stats_by_hand() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        part = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if part in _WRITERS:
            continue
        found = hand_pooling(path.read_text(encoding="utf-8"))
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert not offenders, "read tensor_stats_global instead:\n" + json.dumps(offenders, indent=1)
