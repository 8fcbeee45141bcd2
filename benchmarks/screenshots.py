"""Screenshots of dashboard pages over a store, in headless Chromium (README images, bug reports).

    python3 benchmarks/screenshots.py runs/demo --out docs/img --pages runs dynamics cluster
    python3 benchmarks/screenshots.py runs/demo --quick      # smoke run: the Runs page only
    python3 benchmarks/screenshots.py runs/demo-4ranks --out docs/img --suffix 4ranks   # dashboard-cluster-4ranks.png …

Each page is opened in a fresh tab, the script waits until Streamlit finished its run and every plotly
chart drew, then saves ``<out>/dashboard-<page>.png`` of the whole page. Streamlit scrolls inside its own
main pane, so the browser's full-page capture would stop at the window: the window is instead grown to the
pane's scroll height (``--height`` is the starting height) until the page fits, and captured then.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PAGES = {"runs": "runs", "dynamics": "dynamics", "cluster": "cluster", "rollouts": "rollouts", "events": "events",
         "sql": "sql"}
CHROMIUM = "/usr/bin/chromium"
# Done = the script run finished, no lazily loaded element is still a skeleton, and every plotly chart drew.
READY_JS = """() => {
    const app = document.querySelector('[data-testid="stApp"]');
    if (!app || app.getAttribute('data-test-script-state') !== 'notRunning') return false;
    // The app's hidden one-point chart (app._preload_plotly) is not part of what the user sees: not waited for.
    const shown = e => !e.closest('.st-key-plotly_preload');
    if ([...document.querySelectorAll('[data-testid="stSkeleton"]')].some(shown)) return false;
    const boxes = [...document.querySelectorAll('[data-testid="stPlotlyChart"]')].filter(shown).length;
    const drawn = [...document.querySelectorAll('.js-plotly-plot')].filter(e => shown(e) && e.data && e._fullLayout).length;
    return drawn >= boxes ? String(drawn) : false;  // "0" is truthy, 0 would keep waiting
}"""


# How much taller than its window the page's scrolling pane is (Streamlit's main pane scrolls, the
# document does not); 0 once everything shows. Only panes holding the page's block container count: tables
# and legends scroll inside themselves whatever the window's height.
HIDDEN_HEIGHT_JS = """() => {
    const body = document.querySelector('[data-testid="stMainBlockContainer"]') || document.body;
    return Math.max(0, ...[...document.querySelectorAll('*')]
        .filter(e => e.contains(body) && ['auto', 'scroll'].includes(getComputedStyle(e).overflowY))
        .map(e => e.scrollHeight - e.clientHeight));
}"""


def fit_to_content(page, width: int, max_height: int = 12_000) -> int:
    """Grow the viewport until the page's scrolling pane shows all of its content; returns the height."""
    height = page.viewport_size["height"]
    for _ in range(6):  # content may grow once it has room (lazily drawn tables, charts re-laid out)
        hidden = int(page.evaluate(HIDDEN_HEIGHT_JS))
        if hidden <= 1 or height >= max_height:
            break
        height = min(max_height, height + hidden)
        page.set_viewport_size({"width": width, "height": height})
        wait_rendered(page)
        page.wait_for_timeout(300)  # plotly re-lays out charts on resize
    return height


def wait_rendered(page, timeout_ms: int = 300_000) -> int:
    """Block until the page is fully drawn (see READY_JS); returns the number of charts.

    ``notRunning`` alone is not enough: Streamlit loads the plotly and data-grid components lazily and
    shows skeletons until they arrive, which on a busy machine can take seconds after the script ended.
    """
    return int(page.wait_for_function(READY_JS, timeout=timeout_ms, polling=50).json_value())


def screenshots(store: Path, pages: list[str], out: Path, width: int = 1400, height: int = 1000,
                suffix: str = "") -> list[Path]:
    """Serve ``store``, open each page, save a PNG per page (``dashboard-<page>[-<suffix>].png``); returns the
    files written. A page that shows a Streamlit exception or a "Page not found" dialog is warned about."""
    from playwright.sync_api import sync_playwright

    from dynascope.dashboard.serve import serving

    out.mkdir(parents=True, exist_ok=True)
    written = []
    with serving(store) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        for name in pages:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(f"{base}/{PAGES[name]}")
            wait_rendered(page)
            if name == "sql":  # the console shows results only once a query ran: run its example query
                page.get_by_role("button", name="Run query").click()
                page.locator('[data-testid="stDataFrame"]').first.wait_for(timeout=60_000)
                wait_rendered(page)
            fit_to_content(page, width)
            if page.locator('[data-testid="stException"]').count():
                print(f"warning: {name} shows a Streamlit exception", file=sys.stderr)
            if page.get_by_text("Page not found").count():
                print(f"warning: {name} pops 'Page not found'", file=sys.stderr)
            path = out / f"dashboard-{name}{'-' + suffix if suffix else ''}.png"
            page.screenshot(path=str(path))
            written.append(path)
            page.close()
        browser.close()
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", type=Path, help="run directory or store root")
    ap.add_argument("--pages", nargs="+", choices=list(PAGES), default=list(PAGES))
    ap.add_argument("--out", type=Path, default=Path("test-artifacts/screenshots"))
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1000, help="starting window height (grown to fit the page)")
    ap.add_argument("--quick", action="store_true", help="only the Runs page (smoke run)")
    ap.add_argument("--suffix", default="", help="name the files dashboard-<page>-<suffix>.png")
    args = ap.parse_args()
    for path in screenshots(args.store, ["runs"] if args.quick else args.pages, args.out, args.width, args.height,
                            args.suffix):
        print(path)


if __name__ == "__main__":
    main()
