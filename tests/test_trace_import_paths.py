"""Trace import's fast paths give the same answers as the slow, obvious ones: gzip members, files in
parallel, time conversion, kernel classes."""

from __future__ import annotations

import gzip
import json
import math
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import duckdb
import pytest

from dynascope.analyses import temporal_breakdown
from dynascope.analyses.gpu_timeline import _CLASS
from dynascope.importers.trace import import_traces
from dynascope.importers.trace_stage import connect
from dynascope.store import StoreError, open_store

HTA_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "hta"
ROWS = "SELECT count(*), sum(hash(rank, phase, start_ns, dur_ns, step, parent, stream, category, device)) FROM timings"


def rows(run: Path, sql: str = ROWS) -> list[tuple]:
    with open_store(run) as store:
        return store.sql(sql).fetchall()


def trace(rank: int, n: int, *, shift: float = 0.0) -> dict:
    """A small Kineto-shaped trace: two steps, ``n`` launched kernels, CPU ops in between."""
    ev: list[dict] = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1,
                       "ts": shift + 100 * s, "dur": 100} for s in (1, 2)]
    for i in range(n):
        t = shift + 100 + i * 0.75
        ev += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t, "dur": 0.5,
                "args": {"External id": i, "Input Dims": [[4, 4], [4, 4]]}},
               {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t + 0.25,
                "dur": 0.125, "args": {"correlation": i}},
               {"ph": "X", "cat": "kernel", "name": ["gemm", "ncclDevKernel_AllReduce", "Memcpy HtoD"][i % 3],
                "pid": 0, "tid": 7, "ts": t + 1, "dur": 0.5, "args": {"device": 0, "stream": 7, "correlation": i}}]
    return {"schemaVersion": 1, "distributedInfo": {"rank": rank}, "traceEvents": ev}


@pytest.mark.timeout(120)  # a reader that mishandles gzip members loops forever rather than failing
def test_concatenated_gzip_members_read_in_full(tmp_path: Path) -> None:
    data = json.dumps(trace(0, 300), indent=1).encode()
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    (tmp_path / "one" / "t.json.gz").write_bytes(gzip.compress(data))
    cut = len(data) // 2  # `cat a.gz b.gz` is a valid gzip file of both members
    (tmp_path / "two" / "t.json.gz").write_bytes(gzip.compress(data[:cut]) + gzip.compress(data[cut:]))
    a = import_traces([tmp_path / "one"], tmp_path / "run_one", block=4096)
    b = import_traces([tmp_path / "two"], tmp_path / "run_two", block=4096)
    assert a.rows == b.rows and a.rows["kernel"] == 100
    assert rows(tmp_path / "run_one") == rows(tmp_path / "run_two")


def test_parallel_files_same_rows_as_one_at_a_time(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for r in range(5):
        (src / f"rank-{r}.json").write_text(json.dumps(trace(r, 50 + 10 * r, shift=r * 1e3)))
    one = import_traces([src], tmp_path / "one", threads=1, block=2048)
    many = import_traces([src], tmp_path / "many", threads=3, block=2048)
    assert one.rows == many.rows and sorted(many.files) == [0, 1, 2, 3, 4]
    assert rows(tmp_path / "one") == rows(tmp_path / "many")
    assert temporal_breakdown(tmp_path / "one").drop("run_id").equals(temporal_breakdown(tmp_path / "many").drop("run_id"))


def test_first_bad_file_in_order_is_reported_and_nothing_imported(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for r in range(4):
        (src / f"rank-{r}.json").write_text(json.dumps(trace(r, 40)))
    (src / "rank-1.json").write_text(json.dumps(trace(1, 40))[:-300])  # truncated
    (src / "rank-3.json").write_text("not json")
    with pytest.raises(StoreError, match=r"rank-1\.json: truncated"):
        import_traces([src], tmp_path / "run", threads=4)
    assert not (tmp_path / "run").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # staging removed


def _reference_ns(text: str) -> int | None:
    """The DECIMAL route: the number as DuckDB's JSON reader renders it (an integer as written, anything else
    as its double's shortest repr), rounded to 6 decimals, × 1000, rounded."""
    exact = text if text.lstrip("-").isdigit() else repr(float(text))
    d = Decimal(exact).quantize(Decimal("0.000001"), ROUND_HALF_UP) * 1000
    ns = int(d.quantize(Decimal(1), ROUND_HALF_UP))
    return ns if abs(ns) < 2**63 else None


NUMBERS = ["0", "7", "7.0", "-2.5", "0.5", "12345.678", "1.0005", "-0.0015", "123.4567891", "1e-05", "2.5e-4",
           "3999999999999.999", "4000000000001.5", "1682725898236567", "1682725898236567.25",
           "1712195495519689.047", "9007199254740993", "1.5e+20", "68.0", "0.0005", "999.9995"]


def test_ns_conversion_fast_branches_equal_the_decimal_route(tmp_path: Path) -> None:
    src = tmp_path / "numbers.json"
    src.write_text("[" + ", ".join(f'{{"ts": {n}}}' for n in NUMBERS) + "]")
    got = connect().sql(f"SELECT dynascope_ns(ts) FROM read_json('{src}', format = 'array', "
                        "columns = {'ts': 'VARCHAR'})").fetchall()
    assert [g[0] for g in got] == [_reference_ns(n) for n in NUMBERS]


NAMES = ["ncclKernel_AllReduce", "nccl\nKernel", "ncclAllReduce", "ncclSync", "Memcpy DtoD", "Memset (Device)",
         "dma_copy", "xMemcpy", "cudaStreamSync", "a\nMemcpy", "a\nSync", "gemm", "", "x Memset", "nccl Memcpy Kernel"]


def _hta_class(name: str) -> str:
    """hta.utils.utils' rules with Python's re (whose '.' stops at a newline too)."""
    if re.match(r"^nccl.*Kernel", name):
        return "COMMUNICATION"
    if re.match(r"^(Memcpy|Memset|dma)", name):
        return "MEMORY"
    if not (re.match(r"^nccl.*Kernel", name) or re.match(r"^.*(Memcpy|Sync)", name) or name.startswith("Memset")):
        return "COMPUTATION"
    return "OTHER"


def test_kernel_classes_match_hta_rules() -> None:
    con = duckdb.connect()
    got = con.execute(f"SELECT {_CLASS} FROM unnest(?::VARCHAR[]) AS t(phase)", [NAMES]).fetchall()
    assert [g[0] for g in got] == [_hta_class(n) for n in NAMES]


def test_real_trace_breakdown_unchanged_by_block_and_parallelism(tmp_path: Path) -> None:
    src = HTA_TRACES / "trace_filter"
    if not src.is_dir():
        pytest.skip(f"shared trace fixtures not found at {src}")
    import_traces([src], tmp_path / "a", threads=1)
    import_traces([src], tmp_path / "b", threads=2, block=1 << 16)
    assert rows(tmp_path / "a") == rows(tmp_path / "b")
    a, b = temporal_breakdown(tmp_path / "a"), temporal_breakdown(tmp_path / "b")
    assert all(math.isclose(x, y) for x, y in zip(a["idle_time_us"], b["idle_time_us"], strict=True))
