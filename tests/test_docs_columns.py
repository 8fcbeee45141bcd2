"""Every column the README and docs/ name exists in the schema (``store/schema.py``), under its current name.

Three kinds of reference are checked, the ones that can be told apart from prose reliably:
- markdown tables with a header cell naming columns ("column", "columns", "key columns"): each backticked
  name in that column is a column of the table the row's first cell names (or of any table when it names
  none); ``_frac`` after ``drift_changed_count /`` stands for ``drift_changed_frac``;
- inline code spans with ``table.column`` (``runs.framework``) where ``table`` is a store table;
- SQL in code (quoted strings and code spans that start with SELECT or WITH): bound by DuckDB against an
  empty store, so a column or table the schema lacks fails the binder.
A name the schema has renamed (``store.schema.RENAMED``) is reported as the old name it is.
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pytest

from dynascope.store.pooling import GLOBAL, global_sql
from dynascope.store.schema import RENAMED, TABLES, sql_type

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _create(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """Every store table, empty and typed as the schema types it, and the canonical view over them."""
    for table, schema in TABLES.items():
        con.execute(f"CREATE TABLE {table} ({', '.join(f'{f.name} {sql_type(f.type)}' for f in schema)})")
    con.execute(f"CREATE VIEW {GLOBAL} AS {global_sql()}")
    return con


with _create(duckdb.connect(":memory:")) as _con:
    VIEWS = {GLOBAL: {r[0] for r in _con.execute(f"DESCRIBE {GLOBAL}").fetchall()}}
COLUMNS = {**{t: set(s.names) for t, s in TABLES.items()}, **VIEWS}
ALL_COLUMNS = set().union(*COLUMNS.values())
OLD = {t: {old: new for new, old in renamed.items()} for t, renamed in RENAMED.items()}

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
TABLE_DOT_COLUMN = re.compile(r"(?<![\w.])(" + "|".join(sorted(COLUMNS, key=len, reverse=True)) + r")\.([a-z_][a-z0-9_]*)\b(?!\()")
QUOTED = re.compile(r'"""(.*?)"""|"((?:[^"\\\n]|\\.)*)"|\'((?:[^\'\\\n]|\\.)*)\'', re.S)
FILE_SUFFIXES = {"csv", "json", "jsonl", "parquet", "duckdb", "py", "md", "safetensors", "pt", "txt"}
SQL_START = re.compile(r"^\s*(SELECT|WITH)\b.*\bFROM\b", re.I | re.S)


def _problem(name: str, table: str | None) -> str | None:
    """Why ``name`` is not a column of ``table`` (of any table when None), or None when it is one."""
    columns = COLUMNS[table] if table else ALL_COLUMNS
    if name in columns:
        return None
    tables = [table] if table else list(OLD)
    renamed = [f"{t}.{OLD[t][name]}" for t in tables if name in OLD.get(t, {})]
    if renamed:
        return f"`{name}` is an old name: now {renamed[0]}"
    return f"`{name}` is not a column of {table or 'any table'}"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def table_references(text: str) -> list[tuple[int, str, str | None]]:
    """(line, column name, its table or None) for each name in a column-naming column of a markdown table."""
    out: list[tuple[int, str, str | None]] = []
    lines = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text).split("\n")
    i = 0
    while i < len(lines):
        if not (lines[i].lstrip().startswith("|") and i + 1 < len(lines) and set(lines[i + 1].strip()) <= set("|-: ")
                and "-" in lines[i + 1]):
            i += 1
            continue
        header = [c.lower().strip("`*") for c in _cells(lines[i])]
        cols = [k for k, c in enumerate(header) if re.fullmatch(r"(key )?columns?( .*)?", c)]
        i += 2
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            cells = _cells(lines[i])
            first = CODE_SPAN.findall(cells[0]) if cells else []
            table = first[0] if first and first[0] in COLUMNS else None
            for k in cols:
                previous = None
                cell = re.sub(r"\([^()]*\)", "", cells[k]) if k < len(cells) else ""  # parentheses are prose
                for span in CODE_SPAN.findall(cell):
                    name = span.split("[")[0].strip()
                    if name.startswith("_") and previous:  # `drift_changed_count` / `_frac`
                        name = previous.rsplit("_", 1)[0] + name
                    if IDENT.fullmatch(name) and name not in COLUMNS:
                        out.append((i + 1, name, table))
                        previous = name
            i += 1
    return out


def inline_references(text: str) -> list[tuple[int, str, str]]:
    """(line, column, table) for each ``table.column`` inside a code span (not a file name such as events.csv)."""
    out = []
    prose = FENCE.sub(lambda m: " " * len(m.group(0)), text)
    for span in CODE_SPAN.finditer(prose):
        for m in TABLE_DOT_COLUMN.finditer(span.group(1)):
            if m.group(2) not in FILE_SUFFIXES:
                out.append((text.count("\n", 0, span.start()) + 1, m.group(2), m.group(1)))
    return out


def sql_snippets(text: str) -> list[tuple[int, str]]:
    """(line, SQL) for quoted strings in code blocks and code spans that start with SELECT or WITH."""
    out = []
    for block in FENCE.finditer(text):
        code = block.group(0)
        for q in QUOTED.finditer(code):
            sql = next(g for g in q.groups() if g is not None)
            if q.start() > 0 and code[q.start() - 1] in "fF":
                continue  # an f-string is a template: its text is SQL only once Python fills it in
            if SQL_START.match(sql):
                out.append((text.count("\n", 0, block.start() + q.start()) + 1, sql))
    prose = FENCE.sub(lambda m: " " * len(m.group(0)), text)
    for span in CODE_SPAN.finditer(prose):
        if SQL_START.match(span.group(1)):
            out.append((text.count("\n", 0, span.start()) + 1, span.group(1)))
    return out


@pytest.fixture(scope="module")
def empty_store():
    """A DuckDB database with every store table, empty, typed as the schema types it."""
    con = _create(duckdb.connect(":memory:"))
    yield con
    con.close()


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_every_column_in_the_docs_tables_and_code_exists():
    found, seen = [], 0
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for line, name, table in [*table_references(text), *inline_references(text)]:
            seen += 1
            if (why := _problem(name, table)) is not None:
                found.append(f"{_where(path, line)}: {why}")
    assert seen > 50, "the README's table of tables and columns was not found"  # the check reads something
    assert not found, "\n".join(found)


def test_every_query_in_the_docs_binds_against_the_schema(empty_store):
    found, bound = [], 0
    for path in DOCS:
        for line, sql in sql_snippets(path.read_text(encoding="utf-8")):
            sql = sql.replace('\\"', '"').replace("?", "NULL")
            try:
                empty_store.execute(f"EXPLAIN {sql}")
                bound += 1
            except duckdb.BinderException as exc:
                names = re.findall(r'column "([^"]+)"', str(exc))
                why = _problem(names[0], None) if names else None
                found.append(f"{_where(path, line)}: {why or str(exc).splitlines()[0]}\n    {sql[:120]}")
            except duckdb.Error as exc:  # a table the store lacks, or SQL DuckDB cannot read
                found.append(f"{_where(path, line)}: {str(exc).splitlines()[0]}\n    {sql[:120]}")
    assert bound >= 3, "no query found in the README"
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("text", "want"), [
    ("| table | key columns |\n|---|---|\n| `events` | `kind`, `severity` (`fault`, …) |\n",
     ["`kind` is an old name: now events.event"]),
    ("| column | formula |\n|---|---|\n| `drift_changed_count` / `_fracs` | x |\n",
     ["`drift_changed_fracs` is not a column of any table"]),
    ("rows carry `runs.frameworks` and `store.events.write_detected_events`\n",
     ["`frameworks` is not a column of runs"]),
    ("| table | columns |\n|---|---|\n| `samples` | `reward`, `gen_ms`, `sigma[k]` |\n",
     ["`sigma` is not a column of samples"]),
    ("| column | formula |\n|---|---|\n| `changed_bf16_count` / `_frac` | x |\n",  # schema v3 renamed both
     ["`changed_bf16_count` is an old name: now tensor_stats.changed_rel_count",
      "`changed_bf16_frac` is an old name: now tensor_stats.changed_rel_frac"]),
])
def test_a_wrong_column_is_reported(text, want):
    got = [_problem(name, table) for _, name, table in [*table_references(text), *inline_references(text)]]
    assert [g for g in got if g] == want


def test_a_query_with_an_old_column_fails_to_bind(empty_store):
    ((_, sql),) = sql_snippets('```bash\ndynascope sql runs/x "SELECT kind, count(*) FROM events GROUP BY 1"\n```\n')
    with pytest.raises(duckdb.BinderException, match='"kind"'):
        empty_store.execute(f"EXPLAIN {sql}")
