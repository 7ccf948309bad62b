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


if __name__ == "__main__":
    main()
