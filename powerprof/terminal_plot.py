"""Character charts and figure-keeping paragraphs for the terminal: a measured curve per panel, the chosen point marked, a figure never parted from its unit (presentation only).

Glyphs carry the meaning (● measured, ★ chosen, · straight line between levels), colour only adds
to it, so the chart reads the same with NO_COLOR, in a log file or on a monochrome terminal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

POINT, CHOSEN, LINE = "●", "★", "·"
MIN_PANEL_W = 30  # narrower than this the labels crowd the plot
MAX_PANEL_W = 60
SIDE_BY_SIDE_W = 2 * 36 + 2  # two panels of at least 36 columns and a gap


@dataclass(frozen=True)
class Panel:
    """One curve: y against the level, with the chosen level marked."""

    title: str  # e.g. "GPU J/token"
    x: tuple[float, ...]
    y: tuple[float | None, ...]  # None or NaN: not measured (no point drawn)
    chosen_x: float | None
    x_unit: str
    y_format: str = ".3g"


def _finite(v) -> bool:
    return v is not None and math.isfinite(v)


def _col(v: float, lo: float, hi: float, n: int) -> int:
    return 0 if hi == lo else round((v - lo) / (hi - lo) * (n - 1))


def _row(v: float, lo: float, hi: float, n: int) -> int:
    """Row 0 is the top (the highest value)."""
    return n // 2 if hi == lo else (n - 1) - round((v - lo) / (hi - lo) * (n - 1))


def panel_lines(p: Panel, width: int, height: int = 8) -> list[Text]:
    """The panel as `height + 3` lines of at most `width` cells: title, plot rows, axis, level labels."""
    pts = sorted((x, y) for x, y in zip(p.x, p.y) if _finite(y))
    title = Text(p.title, style="bold")
    if not pts:
        return [title, Text("  (nothing measured)", style="dim")]
    ys = [y for _, y in pts]
    y_lo, y_hi = min(ys), max(ys)
    labels = [format(y_hi, p.y_format), format((y_lo + y_hi) / 2, p.y_format), format(y_lo, p.y_format)]
    lab_w = max(len(s) for s in labels)
    plot_w = max(8, width - lab_w - 2)
    xs = [x for x, _ in pts]
    x_lo, x_hi = min(xs), max(xs)
    # Points inset by one column each side, so the markers never sit on the axis line.
    inner = plot_w - 2
    cells: dict[tuple[int, int], tuple[str, str]] = {}
    for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
        ca, cb = _col(xa, x_lo, x_hi, inner), _col(xb, x_lo, x_hi, inner)
        for c in range(ca + 1, cb):
            y = ya + (yb - ya) * (c - ca) / (cb - ca)
            cells[(_row(y, y_lo, y_hi, height), c)] = (LINE, "dim")
    for x, y in pts:
        cells[(_row(y, y_lo, y_hi, height), _col(x, x_lo, x_hi, inner))] = (POINT, "cyan")
    chosen_col = None
    if p.chosen_x is not None:
        for x, y in pts:
            if x == p.chosen_x:
                chosen_col = _col(x, x_lo, x_hi, inner)
                cells[(_row(y, y_lo, y_hi, height), chosen_col)] = (CHOSEN, "bold red")
    out = [title]
    label_rows = {0: labels[0], (height - 1) // 2: labels[1], height - 1: labels[2]} if y_hi != y_lo else \
        {height // 2: labels[0]}
    for r in range(height):
        line = Text(f"{label_rows.get(r, ''):>{lab_w}} ┤" if r in label_rows else " " * lab_w + " │", style="dim")
        line.append(" ")
        for c in range(inner):
            g, style = cells.get((r, c), (" ", ""))
            line.append(g, style=style)
        out.append(line)
    out.append(Text(" " * lab_w + " └" + "─" * (plot_w - 1), style="dim"))
    out.append(_x_labels(pts, p, x_lo, x_hi, inner, lab_w + 3, chosen_col, width))
    return out


def _x_labels(pts, p: Panel, x_lo, x_hi, inner, offset, chosen_col, width) -> Text:
    """Level values under their columns; the chosen one first so it is never crowded out."""
    buf = [" "] * (offset + inner + 8)
    styles: list[tuple[int, int]] = []
    order = sorted({x for x, _ in pts}, key=lambda x: (x != p.chosen_x, x))
    for x in order:
        s = f"{x:g}"
        start = offset + _col(x, x_lo, x_hi, inner) - len(s) // 2
        start = max(offset, min(start, len(buf) - len(s) - 1))
        if any(ch != " " for ch in buf[max(0, start - 1):start + len(s) + 1]):
            continue  # would touch a label already placed
        buf[start:start + len(s)] = list(s)
        if x == p.chosen_x:
            styles.append((start, start + len(s)))
    text = "".join(buf).rstrip()
    unit = f" {p.x_unit}"
    if len(text) + len(unit) <= width:
        text += unit
    t = Text(text[:width])
    for a, b in styles:
        t.stylize("bold red", a, b)
    return t


class Curves:
    """Panels side by side when the terminal is wide enough, else one under the other."""

    def __init__(self, panels: list[Panel], legend: str = "", height: int = 8):
        self.panels = panels
        self.legend = legend
        self.height = height

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        w = options.max_width
        if len(self.panels) > 1 and w >= SIDE_BY_SIDE_W:
            pw = min(MAX_PANEL_W, (w - 2 * (len(self.panels) - 1)) // len(self.panels))
            grid = Table.grid(padding=(0, 2))
            for _ in self.panels:
                grid.add_column(width=pw, no_wrap=True)
            cols = [panel_lines(p, pw, self.height) for p in self.panels]
            n = max(len(c) for c in cols)
            for i in range(n):
                grid.add_row(*(c[i] if i < len(c) else Text("") for c in cols))
            yield grid
        else:
            pw = max(MIN_PANEL_W, min(MAX_PANEL_W, w))
            for k, p in enumerate(self.panels):
                if k:
                    yield Text("")
                for line in panel_lines(p, pw, self.height):
                    line.no_wrap = True
                    line.overflow = "crop"
                    yield line
        if self.legend:
            yield Text.from_markup(self.legend)


class Together:
    """A paragraph of parts (a figure with its unit, "80.8 tok/s"), wrapped only between parts: rich wraps a Text at
    any space, a no-break space included, so at 60 columns a line could end "80.8" and the next begin "tok/s", a
    bare number reading as another figure. A part wider than the line is folded (nothing is cut)."""

    def __init__(self, parts, sep: str = ", ", head: str = "", style: str | None = None):
        self.parts = [p for p in parts if p]
        self.sep, self.head, self.style = sep, head, style

    def _lines(self, width: int) -> list[str]:
        from rich.cells import cell_len

        out, line = [], self.head
        for k, p in enumerate(self.parts):
            piece = p + (self.sep.rstrip() if k < len(self.parts) - 1 else "")
            gap = self.sep[len(self.sep.rstrip()):] if k else ""
            if line.strip() and cell_len(line + gap + piece) > width:
                out.append(line)
                line = piece
            else:
                line = line + gap + piece if k else line + piece
        out.append(line)
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for line in self._lines(options.max_width):
            yield Text(line, style=self.style or "", no_wrap=False, overflow="fold")

    def __rich_measure__(self, console: Console, options: ConsoleOptions):
        from rich.cells import cell_len
        from rich.measure import Measurement

        widest = max([cell_len(self.head)] + [cell_len(p) + len(self.sep) for p in self.parts])
        return Measurement(min(widest, options.max_width), min(cell_len("".join(self._lines(10**6))), options.max_width))
