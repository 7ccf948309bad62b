"""Command line: thin click commands that wire the layers together and print results."""

from __future__ import annotations

import sys
from pathlib import Path

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


# --- control: power-limit and clock restore (issue 3) ----------------------------------------


@main.command()
@simulate_option
@click.option(
    "--restore-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Restore from this file instead of every restore file in the state folder.",
)
def restore(simulate: str | None, restore_file: Path | None) -> None:
    """Put back every power limit and clock lock a crashed or killed powerprof left changed."""
    from powerprof.control.restore import restore_from_file

    report = restore_from_file(restore_file, simulate=simulate)
    for line in report.lines():
        click.echo(line, err=not report.ok)
    if not report.ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
