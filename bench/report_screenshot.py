"""Bench: screenshots of the HTML report by headless Chromium, and the sweep's end screen as text, for docs/.

Runs a short simulated sweep with `powerprof sweep` (its end screen captured at 80 columns, no
colour), lets the sweep's analysis write report.html, opens it in headless Chromium at 1280 px
and keeps two crops: the top (recommendation and tables) and the first two plots, found in the
page by their own pixels. PNGs are reduced to a 128-colour palette to stay a few hundred KB.
Prints the files, their sizes and where each plot sits on the page.

    .venv/bin/python bench/report_screenshot.py [--out docs] [--run DIR] [--chromium chromium]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

WIDTH = 1280
TALL = 7000  # the window is this tall, so one screenshot holds the whole report (trimmed after)
SWEEP = ["--limits", "180,220,260,300", "--simulate", "--max-time", "20"]  # the README's first command


def run_sweep(run_dir: Path) -> str:
    env = {**os.environ, "COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "powerprof.cli", "sweep", *SWEEP, "--out", str(run_dir)],
                       env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"sweep failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    print(f"sweep: {time.monotonic() - t0:.0f} s")
    return r.stdout


def screenshot(html: Path, out_png: Path, chromium: str) -> None:
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--run-all-compositor-stages-before-draw", "--virtual-time-budget=5000",
           f"--window-size={WIDTH},{TALL}", f"--screenshot={out_png}", html.resolve().as_uri()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if not out_png.exists():
        raise SystemExit(f"chromium wrote no screenshot:\n{r.stderr[-2000:]}")


def find_image(page: np.ndarray, img: np.ndarray) -> tuple[int, int] | None:
    """Top-left corner of `img` inside `page` (both HxWx3), matched on its busiest row."""
    h, w = img.shape[:2]
    k = int(np.argmax((img < 200).any(axis=2).sum(axis=1)))
    row = img[k].astype(int)
    # The report's text column starts 40 px in at this width; look there first, then nearby.
    for x0 in sorted(range(0, page.shape[1] - w + 1), key=lambda x: abs(x - 40))[:121]:
        strip = page[k:page.shape[0] - h + k + 1, x0:x0 + w].astype(int)
        diff = np.abs(strip - row[None]).mean(axis=(1, 2))
        y = int(np.argmin(diff))
        if diff[y] < 3:
            return x0, y
    return None


def save_small(img: Image.Image, path: Path) -> int:
    img.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return path.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs"))
    ap.add_argument("--run", type=Path, default=None,
                    help="An analysed run directory; if missing, the simulated sweep runs into it (default: a temp dir).")
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser") or "chromium")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pp-shot-"))
    a.out.mkdir(parents=True, exist_ok=True)
    run_dir = a.run or tmp / "run"
    if not run_dir.exists():
        text = run_sweep(run_dir)
        (a.out / "sweep-end-screen.txt").write_text(text)
        print(f"end screen: {a.out / 'sweep-end-screen.txt'} ({len(text.splitlines())} lines, "
              f"widest {max(len(x) for x in text.splitlines())} columns)")
    analysis = run_dir / "analysis"
    shot = tmp / "page.png"
    t0 = time.monotonic()
    screenshot(analysis / "report.html", shot, a.chromium)
    print(f"chromium: {time.monotonic() - t0:.1f} s")
    page = Image.open(shot).convert("RGB")
    arr = np.asarray(page)
    busy = np.flatnonzero((arr < 245).any(axis=(1, 2)))
    page = page.crop((0, 0, WIDTH, int(busy[-1]) + 24))
    arr = np.asarray(page)
    print(f"page: {page.size[0]} x {page.size[1]} px")
    out = {"report-top.png": page.crop((0, 0, WIDTH, 900))}
    where = {}
    for name in ("j_per_token", "tok_s"):
        img = np.asarray(Image.open(analysis / f"{name}.png").convert("RGB"))
        where[name] = find_image(arr, img), img.shape[:2]
        print(f"{name}.png ({img.shape[1]} x {img.shape[0]} px) found at {where[name][0]} (shown at native size)")
    (pos_a, _), (pos_b, (hb, _)) = where["j_per_token"], where["tok_s"]
    if pos_a and pos_b:
        out["report-plots.png"] = page.crop((0, max(0, pos_a[1] - 16), WIDTH, pos_b[1] + hb + 16))
    for name, img in out.items():
        size = save_small(img, a.out / name)
        print(f"{a.out / name}: {img.size[0]} x {img.size[1]} px, {size / 1024:.0f} KiB")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
