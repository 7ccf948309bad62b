"""Command line: thin click commands that wire the layers together and print results."""

from __future__ import annotations

import click

from powerprof import __version__
from powerprof.sim.profiles import DEFAULT_PROFILE, PROFILES

SIMULATE_HELP = f"Use a simulated GPU (profiles: {', '.join(PROFILES)}; default {DEFAULT_PROFILE})."


def simulate_option(f):
    return click.option(
        "--simulate",
        "simulate",
        is_flag=False,
        flag_value=DEFAULT_PROFILE,
        default=None,
        type=click.Choice(sorted(PROFILES)),
        help=SIMULATE_HELP,
    )(f)


@click.group()
@click.version_option(__version__, prog_name="powerprof")
def main() -> None:
    """Power and efficiency profiler for GPUs serving LLMs."""


# --- analysis (issue 6): analyze, export -------------------------------------------------------


def _fraction(text: str) -> float:
    """'10%', '10' or '0.1' → 0.1 (a bare number above 1 is a percentage)."""
    t = str(text).strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a fraction or percentage (e.g. 10% or 0.1)") from None
    return v / 100 if not t.endswith("%") and v > 1 else v


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=str))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for the report, plots and analysis.parquet (default: RUN_DIR/analysis).")
@click.option("--max-slowdown", default="10%", show_default=True,
              help="Slowdown budget for the recommended limit, vs the reference level (10% or 0.1).")
@click.option("--eta", type=float, default=0.5, show_default=True,
              help="Weight of energy in the weighted-cost policy eta*E + (1-eta)*Pmax*T (1: energy only).")
@click.option("--format", "formats", default="md,html", show_default=True, help="Report formats: md, html or both.")
@click.option("--force", is_flag=True, help="Pool runs even if their GPU model or server model differ.")
@click.option("--bootstrap", "n_boot", type=click.IntRange(100, 100_000), default=2000, show_default=True,
              help="Bootstrap resamples for the confidence intervals.")
def analyze(run_dirs, out_dir, max_slowdown, eta, formats, force, n_boot):
    """Curve fits, sweet spot under several policies, report (Markdown/HTML) and PNG plots."""
    from powerprof.analysis.loading import AnalysisError
    from powerprof.analysis.report import analyze_run, console_summary

    fmts = tuple(f.strip() for f in formats.split(",") if f.strip())
    try:
        result = analyze_run(list(run_dirs), out_dir, max_slowdown=_fraction(max_slowdown), eta=eta, formats=fmts,
                             force=force, n_boot=n_boot)
    except AnalysisError as e:
        raise click.ClickException(str(e)) from None
    click.echo(console_summary(result))


@main.command()
@click.argument("src", type=click.Path(path_type=str))
@click.option("--format", "fmt", type=click.Choice(["csv", "xlsx", "parquet"]), required=True)
@click.option("--from", "time_from", default=None, help="Only rows at or after this ISO 8601 time (local unless it has an offset).")
@click.option("--to", "time_to", default=None, help="Only rows before this ISO 8601 time.")
@click.option("--columns", default=None, help="Comma-separated columns to keep (default: all).")
@click.option("--tz", default=None, help="Time zone of the *_local columns and of --from/--to without offset (IANA name; default: this machine's).")
@click.option("--out", default=None, type=click.Path(), help="Output file (xlsx; or one-table csv/parquet) or folder.")
def export(src, fmt, time_from, time_to, columns, tz, out):
    """Spreadsheet-ready CSV, xlsx or Parquet from a run directory or a daemon dataset."""
    from powerprof.analysis.export import ExportError, export as run_export

    cols = [c.strip() for c in columns.split(",") if c.strip()] if columns else None
    try:
        paths = run_export(src, fmt, out, time_from, time_to, cols, tz)
    except ExportError as e:
        raise click.ClickException(str(e)) from None
    for p in paths:
        click.echo(str(p))


if __name__ == "__main__":
    main()
