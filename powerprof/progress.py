"""Rich progress and tables on the terminal for `powerprof sweep` (presentation only)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from powerprof.sweep import UI, LevelVisit


def _f(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


class RichSweepUI(UI):
    """One progress line per level: level i/n, requests, live tok/s, W, J/token, CI."""

    def __init__(self, console: Console | None = None, min_requests: int = 5):
        self.console = console or Console(stderr=True)
        self.min_requests = min_requests
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._task = None
        self._unit = "W"

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def idle(self, seconds: float) -> None:
        self.console.log(f"idle baseline: {seconds:g} s with no load")

    def level_start(self, i: int, n: int, visit: LevelVisit, unit: str) -> None:
        self._unit = unit
        rep = f" (repeat {visit.repeat + 1})" if visit.repeat else ""
        self._task = self.progress.add_task(
            f"level {i + 1}/{n}: {visit.level_value:g} {unit}{rep}", total=self.min_requests, info="settling"
        )

    def _info(self, live: dict) -> str:
        ci = f"±{live['ci_pct']:.1f}%" if live.get("ci_pct") is not None and live["ci_pct"] != float("inf") else "±?"
        return (
            f"{live['requests']} req  {_f(live['tok_s'], '.1f')} tok/s  {_f(live['power_w'], '.0f')} W  "
            f"{_f(live['j_per_token'], '.3f')} J/tok {ci}"
        )

    def level_progress(self, visit: LevelVisit, live: dict) -> None:
        if self._task is not None:
            total = max(self.min_requests, live["requests"])
            self.progress.update(self._task, completed=live["requests"], total=total, info=self._info(live))

    def level_done(self, visit: LevelVisit, live: dict) -> None:
        if self._task is not None:
            self.progress.update(self._task, completed=1, total=1, info=self._info(live) + f"  [{visit.stop}]")

    def note(self, text: str) -> None:
        self.console.log(text)


def levels_table(levels, unit: str = "W") -> Table:
    """The per-level result table printed at the end of a sweep."""
    t = Table(title="powerprof sweep", show_lines=False)
    for col in ("level", "enforced", "tok/s", "speed loss", "J/tok GPU", "±CI", "J/tok GPU+CPU", "saving", "SM MHz", "mem MHz", "flags"):
        t.add_column(col, justify="right" if col != "flags" else "left")
    for r in levels.to_pylist():
        t.add_row(
            f"{r['level_value']:g} {unit}" + (" (ref)" if r.get("reference") else ""),
            _f(r.get("enforced_limit_w"), ".0f"),
            _f(r.get("decode_tok_s"), ".1f"),
            _f(r.get("speed_loss_pct"), ".1f") + "%",
            _f(r.get("gpu_j_per_token"), ".3f"),
            _f(r.get("ci_reached_pct"), ".1f") + "%",
            _f(r.get("total_j_per_token"), ".3f"),
            _f(r.get("energy_saving_pct"), ".1f") + "%",
            _f(r.get("sm_clock_mhz"), ".0f"),
            _f(r.get("mem_clock_mhz"), ".0f"),
            r.get("flags") or "",
        )
    return t
