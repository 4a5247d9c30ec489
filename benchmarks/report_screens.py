"""``autoshard report`` on the main job's plan and on a pipelined plan: how long it takes, and
what a browser shows of it.

Each case is planned with the CLI (``--quiet``), then reported with the CLI in a fresh process
(``wall s``: Python start, loading the plan, drawing every figure, writing the page). The page
is then opened in headless chromium: a copy of it with a few lines of script records, after
the page's load event, every image's natural size (an image that failed to decode has width
0), and one screenshot per figure is taken of a copy showing that figure alone, kept under
benchmarks/report/ as evidence of what the page renders.

    python benchmarks/report_screens.py                                  # print the table
    python benchmarks/report_screens.py --out benchmarks/RESULTS.md      # rewrite its section

The helpers (``find_chromium``, ``rendered_images``, ``screenshot_figures``) are also what
tests/test_report.py opens reports with.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import command, machine, revision, today, write_section  # noqa: E402

SECTION = "report"
ROOT = Path(__file__).resolve().parent
SHOTS = ROOT / "report"
CASES = {
    "llama3-8b": "llama3-8b --mesh 8x8 --axes dp,tp --batch 8 --seq 2048",
    "gpt2-tiny-pp": "gpt2-tiny --mesh 2x2 --axes pp,tp --pipeline pp",
}
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHECK_ID = "autoshard-image-check"
# Runs after the load event (every image loaded or failed): one <pre> with each image's size.
CHECK_SCRIPT = f"""<script>
window.addEventListener("load", () => {{
  const sizes = Array.from(document.images).map(i => ({{id: i.id, complete: i.complete,
    width: i.naturalWidth, height: i.naturalHeight}}));
  const pre = document.createElement("pre");
  pre.id = "{CHECK_ID}";
  pre.textContent = JSON.stringify(sizes);
  document.body.appendChild(pre);
}});
</script>"""


def find_chromium() -> str | None:
    """The first chromium-like browser on PATH (Debian's package is ``chromium``)."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def _chromium(browser: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless chromium with a throw-away profile. ``--no-sandbox``: the sandbox refuses to
    start as root (containers, CI); the pages opened are our own files."""
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                               "--hide-scrollbars", "--no-first-run", "--mute-audio",
                               f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout)


def rendered_images(browser: str, page: Path) -> list[dict]:
    """Every ``<img>`` of ``page`` as chromium loaded it: ``{id, complete, width, height}``
    (``width`` the decoded image's natural width: 0 when it failed)."""
    text = page.read_text(encoding="utf-8")
    probe = page.with_name(page.stem + ".check.html")
    probe.write_text(text.replace("</body>", CHECK_SCRIPT + "</body>", 1), encoding="utf-8")
    try:
        r = _chromium(browser, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    finally:
        probe.unlink()
    m = re.search(rf'<pre id="{CHECK_ID}">(.*?)</pre>', r.stdout, re.S)
    if m is None:
        raise RuntimeError(f"chromium did not run the page's check (exit {r.returncode}): "
                           f"{r.stderr.strip()[-500:]}")
    return json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def screenshot_figures(browser: str, page: Path, out_dir: Path, prefix: str) -> list[Path]:
    """One PNG per figure of ``page``: a copy of it showing that figure's section alone,
    screenshot by chromium at the figure's size."""
    text = page.read_text(encoding="utf-8")
    sizes = {s["id"]: s for s in rendered_images(browser, page)}
    out_dir.mkdir(parents=True, exist_ok=True)
    shots = []
    for sid in re.findall(r'<section id="([\w-]+)"><h2>[^<]*</h2><figure>', text):
        size = sizes[f"img-{sid}"]
        style = (f"<style>body > *:not(section#{sid}) {{ display: none; }} "
                 f"body {{ margin: 8px; max-width: none; }}</style>")
        single = page.with_name(f"{page.stem}.{sid}.html")
        single.write_text(text.replace("</head>", style + "</head>", 1), encoding="utf-8")
        out = out_dir / f"{prefix}-{sid}.png"
        try:
            _chromium(browser, f"--window-size={size['width'] + 60},{size['height'] + 150}",
                      f"--screenshot={out}", single.as_uri())
        finally:
            single.unlink()
        if not out.exists():
            raise RuntimeError(f"chromium wrote no screenshot of {sid}")
        shots.append(out)
    return shots


def _cli(*args: str) -> tuple[float, str]:
    """``python -m autoshard ARGS`` in a fresh process: its wall seconds and stdout."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "autoshard", *args], capture_output=True,
                       text=True, cwd=ROOT.parent)
    took = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"autoshard {' '.join(args)} failed: {r.stderr.strip()[-500:]}")
    return took, r.stdout


def run(name: str, case: str, browser: str | None, work: Path) -> tuple[list[str], list[Path]]:
    """One row of the table, and the screenshots taken."""
    plan, page = work / f"{name}.json", work / f"{name}.html"
    plan_s, _ = _cli("plan", *case.split(), "--quiet", "-o", str(plan))
    report_s, out = _cli("report", str(plan), "-o", str(page))
    figures = out.split("(", 1)[1].rsplit(")", 1)[0]
    cells = [f"`autoshard plan {case}`", f"{plan_s:.1f}", f"{report_s:.1f}",
             f"{page.stat().st_size / 2**10:.0f}", figures]
    if browser is None:
        return cells + ["no chromium here", ""], []
    images = rendered_images(browser, page)
    ok = sum(1 for i in images if i["complete"] and i["width"] > 0)
    shots = screenshot_figures(browser, page, SHOTS, name)
    return cells + [f"{ok} of {len(images)}",
                    ", ".join(f"[{p.stem}](report/{p.name})" for p in shots)], shots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="rewrite this section of a RESULTS.md")
    args = ap.parse_args()
    browser = find_chromium()
    version = _chromium(browser, "--version").stdout.strip() if browser else "none"
    rows, shots = [], []
    with tempfile.TemporaryDirectory() as d:
        for name, case in CASES.items():
            row, taken = run(name, case, browser, Path(d))
            rows.append(row)
            shots += taken
            print(" | ".join(row), flush=True)
    head = ["plan", "plan wall s", "`autoshard report` wall s", "page KiB", "figures",
            "images rendered by chromium", "screenshots"]
    lines = ["## `autoshard report`: time, and the page in a browser", "",
             f"- command: `{command('benchmarks/report_screens.py')}`", f"- machine: {machine()}",
             f"- date: {today()}; {revision()}; browser: {version}",
             "- Each plan made by the CLI, then `autoshard report plan.json -o report.html` in "
             "a fresh process (`wall s`: Python start, loading the plan, drawing every figure "
             "with matplotlib, writing one self-contained page). The page then opened in "
             "headless chromium: after its load event every image's natural width is read (0: "
             "failed to decode), and each figure screenshot alone (benchmarks/report/).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if shots:
        lines += [""] + [f"![{p.stem}](report/{p.name})" for p in shots]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)


if __name__ == "__main__":
    main()
