"""`dynascope report`: a run's findings in plain sentences, ranked by time at stake, as text, Markdown or HTML.

Each finding comes with its numbers and a read-only SQL query that shows them (paste it into
``dynascope sql RUN "..."``). Analyses that could not run (missing inputs such as the GPU peak for MFU)
are listed at the end rather than failing the report.
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass, field
from typing import Any

from dynascope.analyses.findings import Finding, collect_findings
from dynascope.analyses.step_shares import phase_shares
from dynascope.analyses.steps import STEP_ROW
from dynascope.core.fmt import fmt_ms, fmt_pct
from dynascope.store import StoreLike, as_store, quote_literal
from dynascope.store.catalog import steps_sql

__all__ = ["FORMATS", "Report", "build_report", "render", "render_run"]

FORMATS = ("text", "markdown", "html")


@dataclass
class Report:
    """Everything a rendered report shows."""

    source: str
    runs: list[dict[str, Any]] = field(default_factory=list)  # run_id, ranks, steps, median_step_ms
    # run → [(label, [(phase, share_pct)])], one entry per (role, stage): ``analyses.phase_shares``
    breakdown: dict[str, list[tuple[str, list[tuple[str, float]]]]] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# The tables the report reads once (``StoreConnection.pin``) when a run's live files are many: all but the
# tensor statistics, which a long run holds in the tens of millions of rows.
PINNED = ("runs", "timings", "samples", "scalars", "events", "system")


def build_report(store: StoreLike, run: str | None = None, *, peak_tflops: float | None = None) -> Report:
    """Collect the summary, the ranked findings and the skipped-analysis notes for a run or a store.

    ``peak_tflops``: dense peak TFLOP/s per device, for MFU where the run's device has no known peak (CPU).
    """
    con = as_store(store)
    rc = "" if run is None else f" WHERE run_id = {quote_literal(run)}"
    runs = con.frame(f"""
        WITH r AS (SELECT DISTINCT run_id FROM runs{rc}),
        st AS (SELECT run_id, step, MAX(dur_us) AS us FROM timings WHERE {STEP_ROW} GROUP BY run_id, step),
        rk AS (SELECT run_id, COUNT(DISTINCT (role, rank)) AS ranks FROM timings GROUP BY run_id),
        n AS ({steps_sql()})
        SELECT r.run_id, coalesce(rk.ranks, 0) AS ranks, coalesce(any_value(n.steps), 0) AS steps,
               median(st.us) / 1000.0 AS median_step_ms
        FROM r LEFT JOIN st USING (run_id) LEFT JOIN rk USING (run_id) LEFT JOIN n USING (run_id)
        GROUP BY r.run_id, rk.ranks ORDER BY r.run_id""")
    rep = Report(str(getattr(con, "path", store)), runs.to_dicts())
    for r in rep.runs:
        shares = phase_shares(con, r["run_id"])
        groups = shares.group_by(["role", "stage"], maintain_order=True)
        several_roles = shares["role"].n_unique() > 1
        for (role, stage), g in groups:
            label = ", ".join(x for x in (role if several_roles else None, stage) if x)
            label = f"{label} ({g['steps'][0]} steps)" if label else ""
            rep.breakdown.setdefault(r["run_id"], []).append(
                (label, list(zip(g["phase"].to_list(), g["share_pct"].to_list(), strict=True))))
    rep.findings, rep.notes = collect_findings(con, run, peak_tflops=peak_tflops)
    return rep


def _said(rep: Report, f: Finding) -> str:
    """The sentence, named by run when the report covers several."""
    return f"{f.run_id}: {f.sentence}" if len(rep.runs) > 1 else f.sentence


def _numbers(f: Finding) -> str:
    return ", ".join(f"{k}={v}" for k, v in f.numbers.items())


def _stake(f: Finding) -> str:
    if not f.at_stake_ms:
        return "no direct time cost"
    pct = f" ({fmt_pct(f.at_stake_pct)} of step time)" if f.at_stake_pct is not None else ""
    return f"at stake: {fmt_ms(f.at_stake_ms)}{pct}"


def _summary_lines(rep: Report) -> list[str]:
    lines = []
    for r in rep.runs:
        med = f", median step {fmt_ms(r['median_step_ms'])}" if r["median_step_ms"] is not None else ""
        lines.append(f"run {r['run_id']}: {r['ranks']} rank(s), {r['steps']} step(s){med}")
        for label, shares in rep.breakdown.get(r["run_id"], []):
            parts = ", ".join(f"{p} {fmt_pct(pct)}" for p, pct in shares)  # every phase: they add up to 100%
            lines.append(f"  step time{', ' + label if label else ''}: {parts}")
    return lines or ["no runs found"]


def render_text(rep: Report) -> str:
    out = [f"dynascope report — {rep.source}", "", *_summary_lines(rep), ""]
    out.append(f"Findings ({len(rep.findings)}), ranked by time at stake:" if rep.findings else
               "No findings: nothing in the recorded data stands out.")
    for i, f in enumerate(rep.findings, 1):
        out += [f"{i}. [{f.severity}] {_said(rep, f)}", f"   {_stake(f)}", f"   numbers: {_numbers(f)}",
                f"   sql: {f.sql}", ""]
    if rep.notes:
        out += ["Skipped:", *(f"  - {n}" for n in rep.notes)]
    return "\n".join(out).rstrip() + "\n"


def render_markdown(rep: Report) -> str:
    summary = [f"  - {line.strip()}" if line.startswith("  ") else f"- {line}" for line in _summary_lines(rep)]
    out = [f"# dynascope report — `{rep.source}`", "", *summary, ""]
    out.append("## Findings" if rep.findings else "No findings: nothing in the recorded data stands out.")
    for i, f in enumerate(rep.findings, 1):
        out += ["", f"{i}. **{_said(rep, f)}** — *{f.severity}*, {_stake(f)}", "",
                f"   Numbers: `{_numbers(f)}`", "", "   ```sql", f"   {f.sql}", "   ```"]
    if rep.notes:
        out += ["", "## Skipped", "", *(f"- {n}" for n in rep.notes)]
    return "\n".join(out).rstrip() + "\n"


_CSS = """body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
li{margin:.8rem 0}.sev{font-size:.75rem;padding:.1rem .4rem;border-radius:.3rem;background:#eee}
.warning{background:#ffe8b3}.error{background:#ffc4c4}pre{background:#f6f6f6;padding:.5rem;overflow-x:auto}
.num{color:#555;font-size:.85rem}"""


def render_html(rep: Report) -> str:
    e = html.escape
    items = []
    for f in rep.findings:
        items.append(f"<li><span class='sev {e(f.severity)}'>{e(f.severity)}</span> <b>{e(_said(rep, f))}</b>"
                     f"<div>{e(_stake(f))}</div><div class='num'>{e(_numbers(f))}</div>"
                     f"<details><summary>SQL</summary><pre>{e(f.sql)}</pre></details></li>")
    body = [f"<h1>dynascope report</h1><p><code>{e(rep.source)}</code></p>",
            "<ul>" + "".join(f"<li>{e(line.strip())}</li>" for line in _summary_lines(rep)) + "</ul>",
            "<h2>Findings</h2><ol>" + "".join(items) + "</ol>" if items else
            "<p>No findings: nothing in the recorded data stands out.</p>"]
    if rep.notes:
        body.append("<h2>Skipped</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in rep.notes) + "</ul>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>dynascope report</title>"
            f"<style>{_CSS}</style></head><body>{''.join(body)}</body></html>\n")


def render(rep: Report, format: str = "text") -> str:
    """The report as ``text``, ``markdown`` or ``html``."""
    renderers = {"text": render_text, "markdown": render_markdown, "html": render_html}
    if format not in renderers:
        raise ValueError(f"unknown --format {format!r} (text, markdown or html)")
    return renderers[format](rep)


def render_run(run: str | os.PathLike, format: str = "text", *, peak_tflops: float | None = None) -> str:
    """The report of the run (or store root) at ``run``, rendered; ``dynascope report`` prints or saves it."""
    if format not in FORMATS:
        raise ValueError(f"unknown --format {format!r} (text, markdown or html)")
    if peak_tflops is not None and not (math.isfinite(peak_tflops) and peak_tflops > 0):
        raise ValueError(f"--peak-tflops must be a positive number, not {peak_tflops}")
    from dynascope.store import open_store

    with open_store(run) as con:
        # 37 queries, most of them over these: each would list and open every live file again (docs/scale.md)
        con.pin(PINNED)
        return render(build_report(con, peak_tflops=peak_tflops), format)
