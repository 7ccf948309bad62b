"""The sweep on the terminal (issue 15, item 3 and the end screen): whole flags, no source-file
suffixes, a progress bar that follows the stopping rule, one result table, and the curve drawn in
the terminal with the chosen level marked, in 80 columns and without colour."""

from __future__ import annotations

import io
import re

import pyarrow as pa
import pytest
from click.testing import CliRunner
from rich.console import Console

from powerprof.cli import main
from powerprof.progress import RichSweepUI, curves, end_screen, level_fraction, levels_table
from powerprof.storage.schema import LEVELS
from powerprof.sweep import LevelVisit, SweepSettings
from powerprof.terminal_plot import CHOSEN, POINT, Curves, Panel, panel_lines


def _text(renderable, width: int, color: bool = False) -> str:
    c = Console(width=width, file=io.StringIO(), record=True, color_system="standard" if color else None,
                force_terminal=color)
    c.print(renderable)
    return c.export_text(styles=False)


def _levels(flags="wide-ci,cap-not-engaged") -> pa.Table:
    rows = [{"level_kind": "power_limit", "level_value": v, "enforced_limit_w": v, "decode_tok_s": 80.0 + v / 10,
             "speed_loss_pct": 3.0, "gpu_j_per_token": 2.5 + v / 1000, "ci_reached_pct": 3.1,
             "total_j_per_token": 3.1, "energy_saving_pct": 5.0, "sm_clock_mhz": 2790.0, "mem_clock_mhz": 10251.0,
             "reference": v == 300.0, "flags": flags} for v in (300.0, 250.0, 200.0)]
    return pa.Table.from_pylist(rows, schema=LEVELS)


@pytest.mark.parametrize("width", [80, 120])
def test_flags_are_never_cut(width):
    text = _text(levels_table(_levels(), "W"), width)
    assert "…" not in text
    flat = re.sub(r"\s+", " ", text)
    assert "wide-ci, cap-not-engaged" in flat or ("wide-ci," in text and "cap-not-engaged" in text)
    assert max(len(line) for line in text.splitlines()) <= width
    if width == 120:
        assert text.count("wide-ci, cap-not-engaged") == 3  # whole, on one line, in 120 columns
        assert "left out" not in text
    else:  # no number cut either: columns left out instead, and said so
        assert "2.700" in text and "left out for width" in text


@pytest.mark.parametrize("width", [40, 60])
def test_too_narrow_for_any_table_every_figure_and_flag_is_still_whole(width):
    # Below ~70 columns even the smallest table did not fit: rich cut figures to "2.4…", folded the flag
    # into "cap-not-e"/"ged" (60 columns) or dropped the flags column altogether (40 columns).
    levels = _levels(flags="cap-not-engaged")
    text = _text(levels_table(levels, "W", recommended=250.0), width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text
    flat = re.sub(r"\s+", " ", text)
    for r in levels.to_pylist():
        for figure in (f"{r['gpu_j_per_token']:.3f}", f"{r['decode_tok_s']:.1f}", f"{r['total_j_per_token']:.3f}"):
            assert figure in flat, (figure, text)
    assert flat.count("cap-not-engaged") == 3
    assert "250 W " + CHOSEN in flat and "300 W (ref)" in flat


def test_log_lines_do_not_end_with_the_source_file():
    buf = io.StringIO()
    ui = RichSweepUI(Console(file=buf, width=100, color_system=None), SweepSettings("power_limit", (300.0,)))
    ui.idle(5.0)
    ui.note("GPU 0 settled at 250 W")
    out = buf.getvalue()
    assert "idle baseline: 5 s" in out and "settled at 250 W" in out
    assert ".py:" not in out


def test_progress_follows_the_stopping_rule_not_min_requests():
    s = SweepSettings("power_limit", (300.0,), min_requests=5, max_requests=200, max_time_s=120.0, target_ci=0.02)
    # min-requests reached but the CI is wide and little time has gone: far from done (the old bar was full).
    assert level_fraction(5, 10.0, 10.0, s) < 0.25
    # Time is the nearest rule: half the time, half the bar.
    assert level_fraction(6, 60.0, 10.0, s) == pytest.approx(0.5)
    # The CI closing on its target fills the bar.
    assert level_fraction(8, 10.0, 2.2, s) == pytest.approx(2.0 / 2.2)
    # Before --min-requests the CI cannot stop the level, so it does not count.
    assert level_fraction(2, 1.0, 1.0, s) < 0.05
    assert level_fraction(200, 1.0, None, s) == 1.0


def test_progress_bar_shows_the_fraction_of_the_level():
    buf = io.StringIO()
    s = SweepSettings("power_limit", (300.0,), min_requests=5, max_time_s=100.0)
    ui = RichSweepUI(Console(file=buf, width=100, color_system=None), s)
    visit = LevelVisit(300.0, 0)
    ui.level_start(0, 1, visit, "W")
    visit.elapsed_s = 25.0
    ui.level_progress(visit, {"requests": 6, "tok_s": 80.0, "power_w": 250.0, "j_per_token": 3.0, "ci_pct": 20.0})
    task = ui.progress.tasks[0]
    assert task.percentage == pytest.approx(25.0)



@pytest.mark.parametrize("concurrency,counted", [(1, "6 req "), (4, "6 batches ")])
def test_progress_counts_what_the_figures_are_over(concurrency, counted):
    # At concurrency 4 the figures and their CI are over batch windows: the line said "24 req" while the
    # wide-ci note of the same level said 188 requests.
    s = SweepSettings("power_limit", (300.0,), concurrency=concurrency)
    ui = RichSweepUI(Console(file=io.StringIO(), width=120, color_system=None), s)
    visit = LevelVisit(300.0, 0)
    ui.level_start(0, 1, visit, "W")
    ui.level_progress(visit, {"requests": 6, "tok_s": 80.0, "power_w": 250.0, "j_per_token": 3.0, "ci_pct": 20.0})
    assert ui.progress.tasks[0].fields["info"].startswith(counted)

def test_a_finished_level_says_why_it_stopped():
    # rich read "[max-time]" as a style tag and dropped it: no progress line ever showed the stop rule.
    buf = io.StringIO()
    ui = RichSweepUI(Console(file=buf, width=120, color_system=None), SweepSettings("power_limit", (300.0,)))
    with ui:
        visit = LevelVisit(300.0, 0)
        ui.level_start(0, 1, visit, "W")
        visit.stop = "max-time"
        ui.level_done(visit, {"requests": 4, "tok_s": 85.7, "power_w": 274.0, "j_per_token": 3.199, "ci_pct": 4.0})
        ui.note("server model [q4_k_m] at 300 W")
    out = buf.getvalue()
    assert "[max-time]" in out
    assert "[q4_k_m]" in out


class _StopAt(RichSweepUI):
    """The rich UI writing to a pipe (a file: not a terminal), raising Ctrl-C once level `at` has measured a request."""

    def __init__(self, buf, at):
        super().__init__(Console(file=buf, width=120, color_system=None), SweepSettings("power_limit", (300.0,)))
        self.at = at

    def level_progress(self, visit, live):
        super().level_progress(visit, live)
        if visit.level_value == self.at and visit.n_measured >= 1:
            raise KeyboardInterrupt


def test_piped_progress_prints_each_level_line_as_it_ends_and_the_stop_below_them(tmp_path):
    # `sweep ... 2>&1 | cat`: rich's live display drew the level lines only when it stopped, so the log read
    # idle baseline, "stopped: 1 finished level kept ...", and only then the two level lines it concluded.
    from powerprof.rig import Rig
    from powerprof.sim.nvml import SimNVML
    from powerprof.sweep import run_sweep
    from powerprof.workload.client import RequestParams

    buf = io.StringIO()
    sim = SimNVML("seed-16g", state_path=None)
    before_w = sim.gpus[0].limit_w
    with Rig("seed-16g", nvml=sim) as rig, _StopAt(buf, 200.0) as ui, pytest.raises(KeyboardInterrupt):
        run_sweep(rig, levels_spec="300,200", out_dir=tmp_path / "run", params=RequestParams(max_tokens=32), idle_s=0.2,
                  interval_s=0.2, min_requests=2, max_requests=2, warmup_requests=0, ui=ui)
    lines = buf.getvalue().splitlines()
    at = {what: next((i for i, line in enumerate(lines) if what in line), None)
          for what in ("idle baseline", "level 1/2: 300 W", "level 2/2: 200 W", "stopped: 1 finished level")}
    assert None not in at.values(), lines
    assert at["idle baseline"] < at["level 1/2: 300 W"] < at["level 2/2: 200 W"] < at["stopped: 1 finished level"], lines
    assert "[max-requests]" in lines[at["level 1/2: 300 W"]] and "[stopped]" in lines[at["level 2/2: 200 W"]], lines
    assert sum("level 1/2" in line for line in lines) == 1  # once, not again as the display stops
    assert sim.gpus[0].limit_w == before_w


def test_a_stop_on_a_terminal_goes_below_the_level_lines_too():
    buf = io.StringIO()
    ui = RichSweepUI(Console(file=buf, width=120, color_system=None, force_terminal=True),
                     SweepSettings("power_limit", (300.0,)))
    with ui:
        visit = LevelVisit(300.0, 0)
        ui.level_start(0, 1, visit, "W")
        ui.stopped("stopped before any level finished: runs/x holds nothing to analyse")
    out = buf.getvalue()
    assert out.rindex("level 1/1: 300 W") < out.index("stopped before any level finished"), out
    assert "[stopped]" in out


def _sweep_cli(tmp_path, *extra):
    return CliRunner().invoke(main, ["sweep", "--simulate", "--limits", "300,200", "--idle-s", "0", "--min-requests",
                                     "2", "--max-requests", "2", "--warmup", "0", "--max-tokens", "32", "--out",
                                     str(tmp_path / "run"), *extra])


def test_sweep_prints_one_table_then_the_curves(tmp_path, monkeypatch):
    # A pipe with no COLUMNS, as a user's `| tee log` has: pytest-xdist's workers set COLUMNS=80, which the
    # progress honours as a user's setting.
    monkeypatch.delenv("COLUMNS", raising=False)
    r = _sweep_cli(tmp_path)
    assert r.exit_code == 0, r.output
    out = r.output
    assert out.count("powerprof sweep: decode only") == 1
    assert out.count("J/token") >= 1 and "chosen by" not in out  # the analysis' own table is not printed again
    assert "GPU J/token" in out and "decode tok/s" in out and f"{CHOSEN} recommended" in out
    assert "Recommended limit:" in out and "run directory:" in out
    # A sweep that finished normally never said the GPU was put back (only interrupted ones did): one line, just
    # before the run directory, with each GPU's original limit.
    lines = out.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("run directory:"))
    assert re.fullmatch(r"GPU 0 back at its original \d+ W limit", lines[at - 1]), lines[at - 2:at + 1]
    # In a pipe the progress lines get 120 columns, as the results do: at 80 the stop rule pushed the
    # elapsed time out ("[max-time] 0:0…").
    assert re.search(r"level 2/2: 200 W .*\[max-requests\] +\d+:\d\d:\d\d", out), out


# --- the curve in the terminal -----------------------------------------------------------------


def _panel(chosen=200.0):
    return Panel("GPU J/token", (150.0, 200.0, 250.0, 300.0), (2.2, 2.6, 3.0, 3.2), chosen, "W")


def _star_columns(lines):
    return [(i, line.index(CHOSEN)) for i, line in enumerate(lines) if CHOSEN in line]


def test_chosen_level_is_a_star_above_its_label():
    lines = [t.plain for t in panel_lines(_panel(), 40, height=8)]
    assert all(len(line) <= 40 for line in lines)
    (row, col), = _star_columns(lines)
    labels = lines[-1]
    # The level value printed under the star's column, and the other levels as points.
    assert labels[col - 1: col + 3].strip().startswith("200") or labels[col - 2: col + 2].strip() == "200"
    assert sum(line.count(POINT) for line in lines) == 3
    # J/token rises with the limit: 150 W's point is on the bottom row, 300 W's on the top row.
    plot = lines[1:9]
    assert POINT in plot[-1][:12] and POINT in plot[0][-4:]


def test_end_screen_fits_80_columns_without_colour(tmp_path):
    from powerprof.analysis.report import analyze_run
    from synthetic_runs import make_run, seed_truth

    import pyarrow.parquet as pq

    run_dir = make_run(tmp_path / "run", seed_truth())
    result = analyze_run([run_dir], n_boot=200, plots=False, formats=())
    levels = pq.read_table(run_dir / "levels.parquet")
    text = _text(end_screen(levels, result, "W"), 80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    rec = result.main.recommendation
    assert f"{CHOSEN} recommended {rec.recommended_value:g} W" in text
    assert text.count(CHOSEN) >= 4  # the table row, both curves, the legend
    assert text.count("powerprof sweep: decode only") == 1
    # The same with colour: the star is styled, the glyphs unchanged.
    c = Console(width=80, file=io.StringIO(), record=True, color_system="truecolor", force_terminal=True)
    c.print(curves(result))
    assert "\x1b[" in c.export_text(styles=True, clear=False) and CHOSEN in c.export_text()


def test_end_screen_of_one_level_stars_nothing(tmp_path):
    # `sweep --limits 300` starred 300 W in the table and both curves, and the legend read
    # "★ recommended 300 W (budget)": one level is chosen over nothing.
    from powerprof.analysis.report import analyze_run
    from synthetic_runs import make_run, seed_truth

    import pyarrow.parquet as pq

    run_dir = make_run(tmp_path / "run", seed_truth(), levels=(300,), n_requests=5)
    result = analyze_run([run_dir], n_boot=200, plots=False, formats=())
    levels = pq.read_table(run_dir / "levels.parquet")
    text = _text(end_screen(levels, result, "W"), 100)
    assert CHOSEN not in text and "recommended 300" not in text and "Other policies" not in text
    assert f"{POINT} measured level" in text and "straight line between levels" not in text
    assert text.count(POINT) == 3  # both curves and the legend show the one point as measured
    assert "One level measured (300 W)" in text


def test_curves_stack_when_the_terminal_is_narrow():
    cv = Curves([_panel(), Panel("tok/s", (150.0, 200.0, 250.0, 300.0), (68.0, 77.0, 82.0, 85.0), 200.0, "W")])
    wide = _text(cv, 100).splitlines()
    narrow = _text(cv, 50).splitlines()
    assert sum("GPU J/token" in line and "tok/s" in line for line in wide) == 1  # side by side
    assert len(narrow) > len(wide) and max(len(line) for line in narrow) <= 50


@pytest.mark.parametrize("width", [40, 48, 60])
def test_a_narrow_terminal_never_parts_a_figure_from_its_unit(width):
    # COLUMNS=60 and below: the per-level paragraphs wrapped at any space, so a line could end "80.8" and the next
    # begin "tok/s" (or "2.800" / "J/tok"): a bare number on a line reads as another figure. Each figure and its
    # unit stay on one line; the paragraph wraps only between figures.
    levels = _levels(flags="cap-not-engaged")
    text = _text(levels_table(levels, "W", recommended=250.0), width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    for r in levels.to_pylist():
        for whole in (f"{r['decode_tok_s']:.1f} tok/s", f"GPU {r['gpu_j_per_token']:.3f} J/tok ±3.1%",
                      f"+CPU {r['total_j_per_token']:.3f} J/tok", "3.0% slower", "5.0% saving",
                      f"enforced {r['enforced_limit_w']:.0f} W", "SM 2790 MHz", "mem 10251 MHz"):
            assert any(whole in line for line in lines), (whole, text)


def test_a_level_a_hair_slower_than_the_reference_prints_0_0_not_minus_0_0():
    rows = [{"level_kind": "power_limit", "level_value": v, "decode_tok_s": 149.8, "speed_loss_pct": -0.04,
             "gpu_j_per_token": 1.76, "ci_reached_pct": 0.5, "energy_saving_pct": -0.03, "reference": v == 700.0,
             "n_windows": 32} for v in (400.0, 700.0)]
    text = _text(levels_table(pa.Table.from_pylist(rows, schema=LEVELS), "W"), 120)
    assert "-0.0%" not in text and "0.0%" in text
    assert "32" in text  # the windows column, where the width allows


def test_end_screen_of_a_concurrent_sweep_says_its_concurrency(tmp_path):
    # `sweep --concurrency 4` titled its table "medians over requests" and its curves by the limit alone: its J/token
    # (per token of 4 streams together) read as one stream's.
    import pyarrow.parquet as pq

    from powerprof.analysis.report import analyze_run
    from synthetic_runs import make_concurrent_run, seed_truth

    run_dir = make_concurrent_run(tmp_path / "run", seed_truth(), 4, n_requests=8)
    result = analyze_run([run_dir], n_boot=200, plots=False, formats=())
    text = " ".join(_text(end_screen(pq.read_table(run_dir / "levels.parquet"), result, "W"), 120).split())
    assert "powerprof sweep at concurrency 4: decode only, medians over batches (tok/s of the 4 streams together)" in text
    assert "medians over requests" not in text
    assert "GPU J/token vs limit (W), concurrency 4" in text and "at concurrency 4 (the 4 streams together)" in text


def test_a_concurrent_sweeps_level_line_counts_batches(tmp_path):
    # The CLI built the progress line's settings without --concurrency: a `--concurrency 2` level said "2 req" where
    # its figures and CI are over 2 batches (the line's own rule, tested above with the settings given).
    r = CliRunner().invoke(main, ["sweep", "--simulate", "--limits", "300", "--concurrency", "2", "--min-requests", "2",
                                  "--max-requests", "2", "--max-tokens", "200", "--idle-s", "0", "--warmup", "0",
                                  "--out", str(tmp_path / "run")], env={"COLUMNS": "160"})
    line = next((x for x in r.stderr.splitlines() if "level 1/1: 300 W" in x), None)
    assert r.exit_code == 0 and line is not None, r.output
    assert "2 batches " in line and " req " not in line, line
