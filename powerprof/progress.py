"""Rich progress, the result table and the end screen on the terminal for `powerprof sweep` (presentation only)."""

from __future__ import annotations

import math
import os
import time

from rich import box
from rich.console import Console, Group
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from powerprof.pipes import silence
from powerprof.sweep import UI, LevelVisit, SweepSettings
from powerprof.terminal_plot import CHOSEN, LINE, POINT, Curves, Panel, Together

BAR_STEPS = 1000  # the bar's total: the fraction of the level done, in thousandths


class QuietPipeConsole(Console):
    """A rich Console that goes quiet when its reader has gone; rich's own raises SystemExit(1)
    from whatever line was printing (mid-sweep, before the analysis) and silences only stdout. It is here, not in
    pipes.py, because every command's exit path imports pipes: rich was loaded by each daemon's stop."""

    pipe_closed = False

    def on_broken_pipe(self) -> None:
        self.quiet = True
        self.pipe_closed = True
        silence(self.file)


def _f(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _pct(v, spec: str = ".1f") -> str:
    """A percentage that rounds to zero printed 0.0%, never -0.0% (a level a hair slower than the reference)."""
    if v is not None and float(format(v, spec)) == 0:
        v = 0.0
    return _f(v, spec) + "%"


def _slower(r: dict) -> str:
    """The level's speed loss, with the digits that keep it on its side of the slowdown budget where the row carries
    it (LevelsTable's max_slowdown: sweetspot.loss_text; 10.0396% read "10.0%" beside "≤ 10% slower")."""
    v, budget = r.get("speed_loss_pct"), r.get("max_slowdown")
    if v is None or budget is None:
        return _pct(v)
    from powerprof.analysis.sweetspot import loss_text  # noqa: PLC0415

    text = loss_text(v, budget)
    return (text[1:] if text.startswith("-") and float(text) == 0 else text) + "%"


def _level_text(value, unit: str) -> str:
    return "settings as they are" if value is None else f"{value:g} {unit}"


def level_fraction(requests: int, elapsed_s: float, ci_pct: float | None, s: SweepSettings) -> float:
    """How far a level is towards its stopping rule, 0..1: whichever of time, request count or CI
    target is nearest to stopping it. The CI part counts only once --min-requests are in (before that
    the CI cannot stop the level), and it is target/CI, reaching 1 as the CI narrows to the target."""
    parts = [elapsed_s / s.max_time_s, requests / s.max_requests]
    if requests >= s.min_requests and ci_pct is not None and math.isfinite(ci_pct) and ci_pct > 0:
        parts.append(100 * s.target_ci / ci_pct)
    return max(0.0, min(1.0, max(parts)))


class RichSweepUI(UI):
    """One progress line per level: level i/n, windows counted (requests, or batches at concurrency > 1), live tok/s, W, J/token, CI.

    The bar follows the sweep's stopping rule (level_fraction), so it fills when the level ends.
    To a pipe or log file each level's line is printed once, as the level ends: rich's live display
    draws there only when stopped, which put every level line below the notes of the whole sweep,
    the "stopped: ..." that concludes them included."""

    def __init__(self, console: Console | None = None, settings: SweepSettings | None = None):
        self.console = console or Console(stderr=True)
        self.settings = settings or SweepSettings(level_kind="power_limit", levels=(1.0,))
        self.progress = Progress(
            # Not markup: the stop rule shown as "[max-time]" was read as a style tag and vanished.
            TextColumn("{task.description}", markup=False),
            BarColumn(bar_width=20),
            TextColumn("{task.fields[info]}", markup=False),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._task = None
        self._unit = "W"
        self.live = self.console.is_terminal and not self.console.is_dumb_terminal

    def __enter__(self):
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.live:  # stop() also prints a blank line to a pipe
            self.progress.stop()

    def _print_level(self) -> None:
        self.console.print(self.progress.make_tasks_table([t for t in self.progress.tasks if t.id == self._task]))

    def _log(self, text: str) -> None:
        # Not console.log: it ends every line with the source file and line (progress.py:42).
        self.console.print(Text.assemble((time.strftime("[%H:%M:%S] "), "dim"), text))

    def idle(self, seconds: float) -> None:
        self._log(f"idle baseline: {seconds:g} s with no load")

    def level_start(self, i: int, n: int, visit: LevelVisit, unit: str) -> None:
        self._unit = unit
        rep = f" (repeat {visit.repeat + 1})" if visit.repeat else ""
        self._task = self.progress.add_task(
            f"level {i + 1}/{n}: {_level_text(visit.level_value, unit)}{rep}", total=BAR_STEPS, info="settling"
        )

    def _info(self, live: dict) -> str:
        ci = f"±{live['ci_pct']:.1f}%" if live.get("ci_pct") is not None and live["ci_pct"] != float("inf") else "±?"
        # At concurrency > 1 the figures are over batch windows (each `concurrency` requests): count those, as
        # the CI is over them; "24 req" read as 24 requests beside a wide-ci note saying 188.
        counted = "req" if self.settings.concurrency == 1 else ("batch" if live["requests"] == 1 else "batches")
        return (
            f"{live['requests']} {counted}  {_f(live['tok_s'], '.1f')} tok/s  {_f(live['power_w'], '.0f')} W  "
            f"{_f(live['j_per_token'], '.3f')} J/tok {ci}"
        )

    def level_progress(self, visit: LevelVisit, live: dict) -> None:
        if self._task is not None:
            f = level_fraction(live["requests"], visit.elapsed_s, live.get("ci_pct"), self.settings)
            # A level ends only at a round's end, so a full bar waits for the round: hold it just short.
            self.progress.update(self._task, completed=min(f, 0.99) * BAR_STEPS, info=self._info(live))

    def level_done(self, visit: LevelVisit, live: dict) -> None:
        if self._task is not None:
            self.progress.update(self._task, completed=BAR_STEPS, info=self._info(live) + f"  [{visit.stop}]")
            if not self.live:
                self._print_level()
            self._task = None

    def note(self, text: str) -> None:
        self._log(text)

    def stopped(self, text: str) -> None:
        # The level in progress ends here, and the note concludes the level lines: it goes below them.
        if self._task is not None:
            info = next(t for t in self.progress.tasks if t.id == self._task).fields.get("info", "")
            self.progress.update(self._task, info=f"{info}  [stopped]")
            self.progress.stop_task(self._task)  # its clock stops with the level
            if not self.live:
                self._print_level()
            self._task = None
        if self.live:
            self.progress.stop()
        self._log(text)


def result_console() -> QuietPipeConsole:
    """stdout; a log file or pipe gets 120 columns so the table is not squeezed to 80, unless
    $COLUMNS says otherwise. A closed pipe silences it (`pipe_closed`) and the work goes on."""
    c = QuietPipeConsole()
    return c if c.is_terminal or os.environ.get("COLUMNS") else QuietPipeConsole(width=120)


# (header, cell) per column; the optional ones go first, in this order, when the terminal is narrow.
_COLUMNS = (
    ("level", lambda r, u: f"{r['level_value']:g} {u}" + (" (ref)" if r.get("reference") else "")),
    ("enforced\nW", lambda r, u: _f(r.get("enforced_limit_w"), ".0f")),
    # The windows the J/token CI rests on (requests at concurrency 1, batches above): under 5 the "95%" CI covers less
    # (flag few-windows), so the count is worth a glance where the width allows.
    ("windows", lambda r, u: _f(r.get("n_windows"), "d")),
    ("tok/s", lambda r, u: _f(r.get("decode_tok_s"), ".1f")),
    ("slower", lambda r, u: _slower(r)),
    ("J/tok\nGPU", lambda r, u: _f(r.get("gpu_j_per_token"), ".3f")),
    ("±CI", lambda r, u: _f(r.get("ci_reached_pct"), ".1f") + "%"),
    ("J/tok\n+CPU", lambda r, u: _f(r.get("total_j_per_token"), ".3f")),
    ("saving", lambda r, u: _pct(r.get("energy_saving_pct"))),
    ("SM\nMHz", lambda r, u: _f(r.get("sm_clock_mhz"), ".0f")),
    ("mem\nMHz", lambda r, u: _f(r.get("mem_clock_mhz"), ".0f")),
    ("flags", lambda r, u: ", ".join(f for f in (r.get("flags") or "").split(",") if f)),
)
_DROP_ORDER = ("mem\nMHz", "enforced\nW", "J/tok\n+CPU", "windows", "SM\nMHz")
TITLE = "powerprof sweep: decode only, medians over requests"


def table_title(rows) -> str:
    """TITLE, or at concurrency > 1 what the figures are then over: batches, and the streams' tok/s together (it said
    "medians over requests" of a `--concurrency 4` sweep, whose J/token read as one stream's)."""
    n = max((int(r["concurrency"]) for r in rows if r.get("concurrency") is not None), default=1)
    return TITLE if n <= 1 else (f"powerprof sweep at concurrency {n}: decode only, medians over batches "
                                 f"(tok/s of the {n} streams together)")


class LevelsTable:
    """The per-level result table printed at the end of a sweep; `recommended` gets a ★.

    Flags are joined with ", " and the column folds, so a long flag list wraps onto more lines
    instead of being cut with an ellipsis. Where the terminal is too narrow for every column,
    the least needed ones are left out (and the caption names them) rather than numbers cut."""

    def __init__(self, levels, unit: str = "W", recommended: float | None = None, max_slowdown: float | None = None):
        self.rows = [r if max_slowdown is None else dict(r, max_slowdown=max_slowdown) for r in levels.to_pylist()]
        self.unit = unit
        self.recommended = recommended

    def table(self, dropped: tuple[str, ...] = ()) -> Table:
        cols = [c for c in _COLUMNS if c[0] not in dropped]
        caption = ("left out for width: " + ", ".join(d.replace("\n", " ") for d in dropped)) if dropped else None
        t = Table(title=table_title(self.rows), caption=caption, box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True)
        for head, _ in cols:
            if head == "flags":
                t.add_column(head, justify="left", overflow="fold", min_width=12)
            else:
                t.add_column(head, justify="right", no_wrap=True)
        for r in self.rows:
            cells = [cell(r, self.unit) for _, cell in cols]
            if self.recommended is not None and r["level_value"] == self.recommended:
                cells[0] += f" {CHOSEN}"
            t.add_row(*cells)
        return t

    def width_needed(self, dropped: tuple[str, ...] = ()) -> int:
        """Columns at full width (flags at their longest single flag), one space each side, and the edges."""
        total = 2
        for head, cell in _COLUMNS:
            if head in dropped:
                continue
            cells = [cell(r, self.unit) + (f" {CHOSEN}" if head == "level" else "") for r in self.rows]
            if head == "flags":
                w = max([12] + [len(f) + 1 for c in cells for f in c.split(", ")])
            else:
                w = max([len(x) for x in head.split("\n")] + [len(c) for c in cells])
            total += w + 2
        return total

    def lines(self) -> Group:
        """One wrapped paragraph per level, every column named: for a terminal too narrow for any table. It wraps
        only between figures (terminal_plot.Together): a figure never ends a line with its unit on the next."""
        out = [Text(table_title(self.rows), style="bold")]
        for r in self.rows:
            head = _COLUMNS[0][1](r, self.unit) + (f" {CHOSEN}" if self.recommended is not None
                                                    and r["level_value"] == self.recommended else "")
            c = {h.replace("\n", " "): cell(r, self.unit) for h, cell in _COLUMNS[1:]}
            parts = [f"{c['tok/s']} tok/s", f"{c['slower']} slower", f"GPU {c['J/tok GPU']} J/tok ±{c['±CI']}",
                     f"+CPU {c['J/tok +CPU']} J/tok", f"{c['saving']} saving", f"enforced {c['enforced W']} W",
                     f"SM {c['SM MHz']} MHz", f"mem {c['mem MHz']} MHz", f"{c['windows']} windows"]
            flags = [f"flags: {c['flags']}"] if c["flags"] else []
            out.append(Together(parts + flags, head=f"{head}: "))
        return Group(*out)

    def __rich_console__(self, console, options):
        for k in range(len(_DROP_ORDER) + 1):
            if self.width_needed(_DROP_ORDER[:k]) <= options.max_width:
                yield self.table(_DROP_ORDER[:k])
                return
        # Narrower than the smallest table: rich would cut figures to "2.4…" and drop or split the flags.
        yield self.lines()


def levels_table(levels, unit: str = "W", recommended: float | None = None,
                 max_slowdown: float | None = None) -> LevelsTable:
    return LevelsTable(levels, unit, recommended, max_slowdown)


def curves(result) -> Curves:
    """J/token and tok/s against the level for the analysis' main series, the recommendation marked."""
    sr = result.main
    unit = "MHz" if sr.series.level_kind == "sm_clock" else "W"
    rows = sr.table.to_pylist()
    x = tuple(float(r["level_value"]) for r in rows)
    rec = sr.recommendation if sr.comparable and result.starred else None
    chosen = rec.level_value if rec is not None else None
    what = (f"SM clock ({unit})" if unit == "MHz" else f"limit ({unit})") + (
        f", concurrency {sr.series.concurrency}" if sr.series.concurrency > 1 else "")
    panels = [
        Panel(f"GPU J/token vs {what}", x, tuple(r["gpu_j_per_token"] for r in rows), chosen, unit),
        Panel(f"decode tok/s vs {what}", x, tuple(r["decode_tok_s"] for r in rows), chosen, unit,
              y_format=".4g"),
    ]
    legend = ((f"[bold red]{CHOSEN}[/] recommended {rec.recommended_value:g} {unit} ({rec.policy})   "
               if rec is not None else "")
              + f"[cyan]{POINT}[/] measured level"
              + (f"   [dim]{LINE}[/] straight line between levels" if len(x) > 1 else ""))
    return Curves(panels, legend)


def end_screen(levels, result, unit: str) -> Group:
    """What a finished sweep prints: one table, the curves, then the recommendation and findings."""
    from powerprof.analysis.report import console_summary

    rec = result.main.recommendation.level_value if result.series and result.main.comparable and result.starred else None
    parts = [levels_table(levels, unit, recommended=rec, max_slowdown=result.params.max_slowdown)]
    if result.series:
        parts += [Text(""), curves(result), Text("")]
    parts.append(Text(console_summary(result, table=False)))
    return Group(*parts)
