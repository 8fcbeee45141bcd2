"""docs/demo.md's transcripts, and README's excerpt of the first, say what the demos print today.

Each transcript is a real run's output (its figures are that run's); what must not go stale is what the
demo prints, row by row. So the tiny demos' transcripts are held against the demo's own printing code run
now, at the transcript's 80 columns, over the session's quick demo: the same table titles, the same row
labels (a label wrapped over two lines read as one), the same closing sentences. The smollm2 transcript is
held against the reproduction table's rows as ``reproduction_rows`` writes them (the RELEX, KL and
log-prob-gap rows among them), and README's excerpt line for line against the first transcript.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from dynascope.demo.report import print_report
from dynascope.demo.reproduction import reproduction_rows
from dynascope.demo.settings import DemoSettings

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "demo.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")
LONG = json.loads((ROOT / "benchmarks" / "results" / "smollm2_long.json").read_text())
TITLES = ("Reward (held-out prompts", "Weight updates: SFT vs RL", "Where RL step time went")
# The closing sentences, by how they start (the rest is the run's figures).
CLOSING = ("dynascope = the probe's own work", "Slowest rank:", "Rollout long tail:", "Rollout tail:",
           "θ₀ (SFT) and the RL policy:", "Explore it:", "Findings:")


def transcript(command: str) -> str:
    """The fenced block of docs/demo.md that starts with ``$ <command>`` (the first such)."""
    blocks = re.findall(r"```\n(\$ [^\n]*\n.*?)```", DOC, flags=re.S)
    found = [b for b in blocks if b.startswith(f"$ {command}")]
    assert found, f"docs/demo.md has no transcript of `{command}`"
    return found[0]


def masked(text: str) -> str:
    return re.sub(r"\d+(?:[.,]\d+)*", "#", " ".join(text.split()))


def labels(text: str) -> list[str]:
    """Each table row's first cell (a row whose other cells are empty continues the label above it), digits
    masked; rows of the step-time table (they start with a role) are left out: their phases are the run's."""
    out: list[str] = []
    for line in text.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells[0] in ("trainer", "rollout"):
            continue
        if out and not any(cells[1:]) and cells[0]:
            out[-1] += " " + cells[0]
        elif cells[0]:
            out.append(cells[0])
    return [masked(x) for x in out]


def closing(text: str) -> list[str]:
    """The closing sentences' starts, in the order the transcript has them."""
    flat = " ".join(text.split())
    return [c for _, c in sorted((flat.find(c), c) for c in CLOSING if c in flat)]


def first_column(text: str) -> str:
    """A table's first column read top to bottom as one text (its rows wrap over several lines each)."""
    return " ".join(line.strip().strip("│").split("│")[0].strip() for line in text.splitlines()
                    if line.startswith("│"))


def printed_now(run: Path) -> str:
    """What the demo prints after training, for ``run``, by its own code now, 80 columns wide."""
    console = Console(width=80, record=True, color_system=None, file=open("/dev/null", "w"))  # noqa: SIM115
    s = DemoSettings.from_json((run / "demo_settings.json").read_text())  # its run_dir is ``run``
    print_report(s, console, 1.0, 1.0)
    return console.export_text()


@pytest.fixture(scope="module")
def now(quick_demo) -> str:
    return printed_now(quick_demo[0])


def test_the_demo_transcript_prints_what_the_demo_prints(now):
    doc = transcript("dynascope demo")
    for title in TITLES:
        assert title in doc and title in now, title
    assert labels(doc) == labels(now)
    assert closing(doc) == closing(now)
    # the probe's cost is said beside what watch()'s defaults and full coverage cost, as printed today
    said = " ".join(now.split())
    note = said[said.index("dynascope = the probe's own work"):said.index("Slowest rank:")]
    assert note in " ".join(doc.split())


def test_the_four_rank_transcript_prints_what_the_demo_prints(now):
    doc = transcript("dynascope demo --ranks 4")
    assert "torchrun ×4" in doc
    assert labels(doc) == labels(now)
    assert closing(doc) == closing(now)
    # its slow rank is named, by the report's own sentence when no single phase is beyond its noise
    line = " ".join(doc.split())
    assert re.search(r"Slowest rank: rank 2 (\(trainer\) in phase|costs )", line), line


def test_the_smollm2_transcript_has_every_reproduction_row():
    """The table's measures, in order, are ``reproduction_rows``' (one RELEX row: the demo fits one window)."""
    doc = transcript("dynascope demo --model smollm2")
    want, seen = [], set()
    for row in reproduction_rows(LONG):
        if masked(row[0]) not in seen:
            seen.add(masked(row[0]))
            want.append(row[0])
    assert masked(first_column(doc)) == masked(" ".join(want))
    flat = " ".join(doc.split())
    assert "Checkpoints: 5 files," in flat and "GB on disk" in flat and "(CPU " in flat


def test_readme_quotes_the_demo_transcript():
    """README's excerpt: every line but its elisions is a line of docs/demo.md's transcript."""
    excerpt = re.search(r"```\n\$ dynascope demo\n(.*?)```", README, flags=re.S)
    assert excerpt
    def run_dir(line: str) -> str:  # the transcript's run directory is README's default one
        return re.sub(r"\S*/demo\b", "runs/demo", line.rstrip())

    doc = [run_dir(d) for d in transcript("dynascope demo").splitlines()]
    for line in excerpt.group(1).splitlines():
        if line.strip() != "…":
            assert run_dir(line) in doc, line
