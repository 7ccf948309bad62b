"""Command line: thin click commands that wire the layers together and print results."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import NoReturn

import click

from powerprof import __version__
from powerprof.sim.profiles import DEFAULT_PROFILE, MAX_SIM_GPUS, PROFILES

SIMULATE_HELP = (f"Use a simulated GPU (profiles: {', '.join(PROFILES)}; default {DEFAULT_PROFILE}); a host of mixed "
                 "cards: one profile per GPU in index order, e.g. h200-141g,l4-24g.")
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}  # inherited by every subcommand
DEFAULT_MAX_TOKENS = 256  # one default for sweep and measure: long enough for multi-second decode windows
# --max-tokens at most powerprof.workload.trace.MAX_TOKENS (a test checks; not imported: numpy at every start): past any
# model's context, a typo. 1e9 was taken, and on a server that does not cut at its context the first request never ended.
TRACE_MAX_TOKENS = 10_000_000
PROMPT_SET_NAMES = ("short", "medium", "long", "mixed")  # powerprof.workload.load.PROMPT_SETS (a test checks)
API_NAMES = ("llamacpp", "openai-completions", "openai-chat")
# Streams at once, the most measure's and sweep's --concurrency take (more than any server batches: vLLM's
# max_num_seqs is 256-1024): `measure --concurrency 100000` was accepted and hung.
MAX_CONCURRENCY = 1024
EXIT_NO_DEVICE = 1  # `devices`: no usable GPU and no RAPL
JSON_HELP = "Print one JSON object (stable keys) instead of text."


def _not_a_number(value, whole: bool) -> str:
    """What click said of `--max-time 30s` ("'30s' is not a valid float range."), in words with the fix."""
    import re

    what = "a whole number" if whole else "a number"
    if re.fullmatch(r"\s*[-+]?(\d+\.?\d*|\.\d+)\s*[^\d\s.].*", str(value)):
        return f"{value!r} is not {what}: give the number alone, without its unit (the option's help says the unit)"
    return f"{value!r} is not {what}" + (" (e.g. 4)" if whole else " (e.g. 30 or 0.5)")


class _FloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf: nan passes every range check (comparisons are
    false) and reached the commands (`trace --rate nan` wrote NaN arrival times; `monitor --duration
    inf` was an OverflowError traceback). Text that is no number is said as such (_not_a_number)."""

    def convert(self, value, param, ctx):
        import math

        if isinstance(value, str):
            try:
                float(value)
            except ValueError:
                self.fail(_not_a_number(value, whole=False), param, ctx)
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv




class _IntRange(click.IntRange):
    """click.IntRange whose refusal of text that is no whole number says so ("'2x' is not a valid integer range.")."""

    def convert(self, value, param, ctx):
        if isinstance(value, str):
            try:
                int(value)
            except ValueError:
                self.fail(_not_a_number(value, whole=True), param, ctx)
        return super().convert(value, param, ctx)


class _Unbounded:
    """A range type without bounds: its help shows the plain metavar (an unbounded range showed "[x<=None]")."""

    metavar = ""

    def _describe_range(self) -> str:
        return ""

    def get_metavar(self, *args, **kwargs):
        return self.metavar


class _Float(_Unbounded, _FloatRange):
    name = "float"
    metavar = "FLOAT"


class _Int(_Unbounded, _IntRange):
    name = "integer"
    metavar = "INTEGER"


class _SimProfiles(click.ParamType):
    """A simulator profile key, or one per GPU joined by commas (a mixed host)."""

    name = "PROFILE[,PROFILE…]"

    def convert(self, value, param, ctx):
        keys = [k.strip() for k in str(value).split(",")]
        bad = [k for k in keys if k not in PROFILES]
        if bad and (os.path.lexists(str(value)) or any(c in str(value) for c in "/.")):
            # `replay --simulate trace.jsonl` took the trace as a profile's name: the option's value is optional, so the
            # word after it is its value whatever it looks like.
            what = "is a file" if os.path.lexists(str(value)) else "looks like a file's name"
            self.fail(f"{str(value)!r} {what}, not a simulated GPU profile: --simulate's profile is optional, so the "
                      f"word after it is read as one. Put the file before --simulate (`{ctx.command_path if ctx else 'powerprof'} "
                      f"{value} --simulate`), or name a profile after it (`--simulate {DEFAULT_PROFILE} {value}`)",
                      param, ctx)
        if bad:
            self.fail(f"{', '.join(repr(k) for k in bad)}: not a simulated GPU profile; choose from "
                      f"{', '.join(sorted(PROFILES))} (one, or one per GPU joined by commas)", param, ctx)
        return ",".join(keys)


def simulate_option(f):
    return click.option(
        "--simulate",
        "simulate",
        is_flag=False,
        flag_value=DEFAULT_PROFILE,
        default=None,
        type=_SimProfiles(),
        help=SIMULATE_HELP,
    )(f)


# Commands a new user may guess from the docs' words, and the one that does it: click offered 'export' and 'restore'
# for `powerprof report` (the README's "report it writes"), by spelling alone.
_GUESSED_COMMANDS = {
    "report": "`powerprof analyze RUN_DIR` writes the report (RUN_DIR/analysis/report.html and report.md); a sweep "
              "writes it as it ends",
    "analyse": "the command is spelt `powerprof analyze`",
}


JSON_SAID = "powerprof_json_said"  # ctx.meta: this command has printed its JSON object (_json_text)
EXIT_SAID = "powerprof_exit_said"  # ctx.meta: why the command stops (_stop_exit), for its --json object


def _stop_exit(text: str, code: int) -> NoReturn:
    """Say why the command stops (stderr) and exit with `code`; under --json, _Command prints the same words as
    `{"ok": false, "error", "exit_code"}` on stdout (before, a Ctrl-C'd `analyze --json` printed no object)."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta[EXIT_SAID] = text
    click.echo(text, err=True)
    sys.exit(code)


def _json_error(ctx: click.Context, e: click.ClickException, asked: bool) -> None:
    """A --json command's error as JSON on stdout too, `{"ok": false, "error": ..., "exit_code": ...}` on one line
    (restore --json said `"ok": false`; analyze --json and measure --json printed nothing on stdout, and a script's
    json.loads failed on the empty text). click still says it on stderr, one line, and exits with its code. Not after
    the command's own object (measure --json's write error): one object a run."""
    if asked and not ctx.meta.get(JSON_SAID):
        click.echo(_json_text({"ok": False, "error": e.format_message(), "exit_code": e.exit_code}))


_PATH_ARGUMENTS = ("run_dirs", "src")  # paths typed as plain strings (globs, URIs among them)


def _check_relative_paths(command: click.Command, ctx: click.Context) -> None:
    """A usage error (exit 2, the fix named) for a relative path given where the current folder was removed: it names
    no place there, and was a FileNotFoundError traceback, or said as a file that does not exist ("no such run
    directory", "cannot read trace"). Every click.Path option and argument, and the sources; URIs pass."""
    from powerprof.paths import cwd_gone  # noqa: PLC0415

    for p in command.params:
        if not (isinstance(p.type, click.Path) or p.name in _PATH_ARGUMENTS):
            continue
        given = ctx.params.get(p.name)
        for v in given if isinstance(given, (tuple, list)) else (given,):
            if isinstance(v, (str, os.PathLike)) and "://" not in str(v):
                flag = p.opts[-1] if isinstance(p, click.Option) else p.human_readable_name
                if (why := cwd_gone(v, flag)) is not None:
                    raise click.UsageError(why, ctx)


class _Command(click.Command):
    """A command whose "unexpected extra argument" says the likely cause: a list given with spaces (`--limits 180 220`,
    `--limits 220 W`) left click's bare "Got unexpected extra argument (220)". With --json, its errors (usage or
    run) are said as JSON on stdout too (_json_error), for every command here in one place."""

    def _asks_json(self, ctx, args=None) -> bool:
        if not any(p.name == "as_json" for p in self.params):
            return False
        if "as_json" in ctx.params:
            return bool(ctx.params["as_json"])
        args = list(args or ())
        return "--json" in (args[:args.index("--")] if "--" in args else args)

    def parse_args(self, ctx, args):
        asked = self._asks_json(ctx, args)
        try:
            rest = super().parse_args(ctx, args)
        except click.UsageError as e:
            if e.message.startswith("Got unexpected extra argument"):
                e.message += (": an option takes one value; give a list comma-separated without spaces "
                              "(--limits 180,220,260), a unit joined to its number (220W), or quote the value")
            _json_error(ctx, e, asked)
            raise
        try:
            _check_sim_gpus(ctx.params.get("simulate"), ctx.params.get("gpus"), "--gpus", ctx)
            _check_relative_paths(self, ctx)
            if self.name in _SENDS_REQUESTS:
                from powerprof.workload.auth import ApiKeyError, api_key

                try:
                    api_key()  # before anything opens: a bad key surfaced deep in a request, not naming the variable
                except ApiKeyError as e:
                    raise click.UsageError(str(e), ctx) from None
        except click.UsageError as e:
            _json_error(ctx, e, asked)
            raise
        return rest

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.ClickException as e:
            _json_error(ctx, e, self._asks_json(ctx))
            raise
        except PermissionError as e:
            # Asked of the module only where it is loaded (it is, where this is its error): importing it to ask loaded
            # numpy and pynvml into every other PermissionError's path.
            nvml = sys.modules.get("powerprof.sim.nvml")
            if nvml is None or not isinstance(e, nvml.SimStateRefused):
                raise
            # The simulator's state file refused (as root in another user's folder, a symlink at its lock), whichever
            # command opened the simulator: one line, exit 1, as click's own errors.
            exc = click.ClickException(str(e))
            _json_error(ctx, exc, self._asks_json(ctx))
            raise exc from None
        except KeyboardInterrupt:
            # A command with no stop path of its own (devices, tag): click said "Aborted!", exit 1 (read as a failure),
            # and under --json no object. Ctrl-C is 130 whatever the output's form.
            ctx.meta[EXIT_SAID] = "interrupted"
            click.echo("interrupted", err=True)
            self._json_exit(ctx, 130, KeyboardInterrupt())
            sys.exit(130)
        except SystemExit as e:
            self._json_exit(ctx, e.code if isinstance(e.code, int) else 1, e)
            raise

    def _json_exit(self, ctx, code: int, e: BaseException) -> None:
        """A stop path's own exit (analyze's Ctrl-C 130, a signal's 128 + n) printed no object on stdout: a script's
        json.loads failed on the empty text. The exit and the stderr line stay the command's."""
        from powerprof import pipes, termination

        # EXIT_PIPE: stdout's reader has gone, there is no one to tell.
        if code in (0, pipes.EXIT_PIPE) or not self._asks_json(ctx) or ctx.meta.get(JSON_SAID):
            return
        why = ctx.meta.get(EXIT_SAID) or (_stopped_how(e) if isinstance(e, (KeyboardInterrupt, termination.Terminated))
                                          else f"exited with code {code}")
        with contextlib.suppress(OSError):
            click.echo(_json_text({"ok": False, "error": why, "exit_code": code}))


_SENDS_REQUESTS = ("measure", "sweep", "replay", "daemon")  # the commands whose requests carry $POWERPROF_API_KEY


def _check_sim_gpus(simulate, gpus, what: str, ctx=None, count: int | None = None) -> None:
    """A simulated host has at most MAX_SIM_GPUS GPUs: `--simulate --gpus 1000000` built a million of them (4.4 GB, every
    command that takes both), 20 digits was an OverflowError. A real machine's indexes are checked against its count,
    and so a simulated one's where its `count` was given (the daemon's --sim-gpus)."""
    big = [g for g in gpus or () if isinstance(g, int) and g >= MAX_SIM_GPUS] if simulate else []
    if big:
        shown = str(big[0]) if len(str(big[0])) <= 24 else str(big[0])[:20] + "…"
        raise click.UsageError(f"{what}: GPU index {shown} does not exist: the simulator has at most {MAX_SIM_GPUS} "
                               f"GPUs (indexes 0-{MAX_SIM_GPUS - 1})", ctx)
    past = [g for g in gpus or () if isinstance(g, int) and g >= count] if simulate and count is not None else []
    if past:  # the words open_sources says of a real machine's
        raise click.UsageError(f"{what}: GPU index {past[0]} does not exist: this machine has {count} GPU(s) "
                               f"(0-{count - 1})", ctx)


class _Group(click.Group):
    """A group of commands (`tag`): its commands are _Command as the top level's are."""

    command_class = _Command


class _Main(click.Group):
    command_class = _Command
    group_class = _Group

    def resolve_command(self, ctx, args):
        if args and args[0] in _GUESSED_COMMANDS and args[0] not in self.commands:
            ctx.fail(f"No such command {args[0]!r}: {_GUESSED_COMMANDS[args[0]]}.")
        return super().resolve_command(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            from powerprof import pipes

            # Our reader has gone (`| head`): exit as SIGPIPE would, quietly. click's own handling
            # exits 1, which reads as a failure; an EPIPE from elsewhere (a socket) stays its error.
            if pipes.silence_closed():
                sys.exit(pipes.EXIT_PIPE)
            raise


@click.group(cls=_Main, context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, prog_name="powerprof")
def main() -> None:
    """Power and efficiency profiler for GPUs serving LLMs."""


# --- foundation: devices, monitor -------------------------------------------------------------


def _parse_gpus(ctx, param, value):
    """NVML indexes as ints; GPU-/MIG- UUIDs stay strings for the collectors to map (a MIG instance to its GPU)."""
    if value is None:
        return None
    out: list = []
    for x in (x.strip() for x in value.split(",")):
        if not x:
            continue
        if x.startswith(("GPU-", "MIG-")):
            out.append(x)
        elif x.isascii() and x.isdigit():  # ascii: "²" is a digit to str.isdigit, and no int
            out.append(int(x))
        else:
            raise click.BadParameter(f"{value!r}: expected NVML indexes like 0 or 0,1, or UUIDs (GPU-…, MIG-…)")
    if not out:
        raise click.BadParameter(f"{value!r}: expected NVML indexes like 0 or 0,1, or UUIDs (GPU-…, MIG-…)")
    return list(dict.fromkeys(out))


# sweep's and measure's --gpus (the GPUs measured, those the server must run on: workload/placement.py) and the way
# past that check. One definition each: the two commands parse, refuse and word them alike.
_server_gpus_option = click.option(
    "--gpus", callback=_parse_gpus,
    help="NVML indexes (or GPU-/MIG- UUIDs) of the GPUs serving the model, e.g. 0,1, measured together; a sweep sets "
         "each level on all of them (default: the GPUs CUDA_VISIBLE_DEVICES shows, else all).")
_allow_unmeasured_option = click.option(
    "--allow-unmeasured-server-gpus", "allow_unmeasured_server_gpus", is_flag=True,
    help="Measure even where the server also runs on a GPU not measured (default: refuse, exit 2): that GPU's "
         "energy is in no figure; the run's notes say so.")


def _tag_header_option(ctx, param, value):
    """replay's --tag-header, by the daemon's proxy.tag_header rule (one validator: workload.auth.check_tag_header)."""
    from powerprof.workload.auth import check_tag_header

    try:
        return check_tag_header(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _levels_option(what: str, example: str):
    """sweep's --limits or --clocks empty or only commas, refused as such before anything opens: `--limits ""` (an
    unset shell variable) said "give exactly one of --limits or --clocks" to a user who had given it, and beside --vary
    swept no levels at all. The levels parser (control.levels) judges the rest; tune's --levels goes to it as given
    (its "no power levels given" is right there, and the levels may be clocks, by the config's knob)."""
    def check(ctx, param, value):
        if value is not None and not value.replace(",", "").strip():
            raise click.UsageError(f"{param.opts[0]} is empty: give {what}, e.g. {param.opts[0]} {example}", ctx)
        return value
    return check


def _open_rig_or_exit(simulate, gpus=None, rapl_backend="sysfs", host=True):
    """The one door, with its collectors open: a GPU index that does not exist is a usage error."""
    from powerprof.rig import Rig

    rig = Rig(simulate, gpus=gpus, rapl_backend=rapl_backend, host=host)
    try:
        rig.sources
    except ValueError as e:
        rig.close()
        raise click.UsageError(str(e)) from None
    except NotADirectoryError as e:  # the simulator's state folder a file (sim.powercap says which, and the fix)
        rig.close()
        raise click.ClickException(str(e)) from None
    return rig


def _rapl_backend_option(f):
    return click.option(
        "--rapl-backend",
        type=click.Choice(["sysfs", "pyrapl"]),
        default="sysfs",
        show_default=True,
        help="How to read RAPL counters: our powercap reader, or pyRAPL's (wraparound is ours either way).",
    )(f)


@main.command()
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@click.option("--gpus", callback=_parse_gpus, help="NVML indexes to show, e.g. 0,1 (default: all visible).")
@_rapl_backend_option
@simulate_option
def devices(as_json, gpus, rapl_backend, simulate):
    """GPUs, their power limits and capabilities, RAPL zones, permissions and how to fix them.

    Exits 1 when it finds no usable GPU and no RAPL zone (nothing powerprof could measure)."""
    import json

    with _open_rig_or_exit(simulate, gpus, rapl_backend) as rig:
        info = rig.describe()
    if as_json:
        click.echo(_json_text(info, indent=2))
    else:
        _print_devices(info)
    if not info["gpus"] and not info["rapl"]:
        where = "the problems in the JSON's `problems`" if as_json else "the problems above"
        click.echo(f"powerprof devices: no usable GPU and no RAPL zone: nothing to measure (see {where})",
                   err=True)
        sys.exit(EXIT_NO_DEVICE)


def _w(v):
    return "-" if v is None else f"{v:g} W"


def _print_devices(info):
    if info["restore_note"]:
        click.secho(info["restore_note"], fg="yellow")
    if info["simulated"]:
        click.echo("(simulated devices)")
    for g in info["gpus"]:
        click.echo(f"gpu{g['index']}  {g['name']}  {g['uuid']}  driver {g['driver_version']}")
        click.echo(
            f"  power limit {_w(g['power_limit_w'])} (enforced {_w(g['enforced_limit_w'])}), "
            f"default {_w(g['default_limit_w'])}, range {_w(g['min_limit_w'])} - {_w(g['max_limit_w'])}"
        )
        sup = [k for k, ok in g["supports"].items() if ok]
        nosup = [k for k, ok in g["supports"].items() if not ok]
        click.echo(f"  readings: {', '.join(sup) or 'none'}" + (f"; not supported: {', '.join(nosup)}" if nosup else ""))
    if not info["gpus"]:
        click.echo("GPUs: none")
    r = info["rapl"]
    if r:
        click.echo(f"RAPL ({r['backend']}, {r['root']}), min wrap period {r['min_wrap_period_s']:.0f} s:")
        for z in r["zones"]:
            rng = "unknown range" if z["max_energy_range_j"] is None else f"range {z['max_energy_range_j']:.0f} J"
            click.echo(f"  {z['zone']:<18} {z['kind']:<8} {z['sysfs_id']:<16} {rng}")
    else:
        click.echo("RAPL: not available")
    h = info["host"]
    if h:
        mem = "-" if h["mem_total_bytes"] is None else f"{h['mem_total_bytes'] / 2**30:.1f} GiB"
        click.echo(f"host: {h['cpu_count']} CPUs, {mem} memory")
    for p in info["problems"]:
        click.secho(f"problem ({p['source']}): {p['message']}", fg="red", err=False)
        if p["fix"]:
            click.echo("  fix: " + p["fix"].replace("\n", "\n       "))


@main.command()
@click.option("--duration", type=_FloatRange(min=0, min_open=True), default=None,
              help="Seconds to run (default: until Ctrl-C).")
@click.option("--interval", type=_FloatRange(0.02, 10.0), default=1.0, show_default=True,
              help="Seconds between samples (0.02-10, i.e. 50-0.1 Hz).")
@click.option("--output", type=click.Path(dir_okay=False), default=None,
              help="Also write every sample to FILE.parquet or FILE.csv (samples schema).")
@click.option("--force", is_flag=True, help="Replace --output (or --recover's FILE) if it exists (default: refuse, it may hold earlier samples).")
@click.option("--recover", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Sample nothing: combine the FILE.parts/ folder a killed `monitor --output FILE` left into FILE "
                   "(.parquet or .csv), then remove the parts.")
@click.option("--gpus", callback=_parse_gpus, help="NVML indexes to show, e.g. 0,1 (default: all visible).")
@click.option("--plain", is_flag=True,
              help="One text line per GPU per interval, even on a terminal (default: live panels on a terminal, lines in a pipe).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per interval (JSON lines, stable keys) for scripts.")
@_rapl_backend_option
@simulate_option
def monitor(duration, interval, output, force, recover, gpus, plain, as_json, rapl_backend, simulate):
    """Live view once per interval: GPU name, load, memory, power and temperature with bars; clocks, energy, reasons; CPU power."""
    from powerprof import monitor as mon

    if plain and as_json:  # --json won unsaid: one output form a run
        raise click.UsageError("--plain and --json are two forms of the same output: give one")
    if recover is not None and output is not None:
        raise click.UsageError("--recover FILE samples nothing: give it without --output")
    try:
        if recover is not None:
            mon.recover_output(recover, force)
            return
        if output is not None:
            mon.check_output(output, force)
        with _open_rig_or_exit(simulate, gpus, rapl_backend) as rig:
            ending = mon.watch(rig, interval, duration, output, force, plain, as_json, echo=click.echo,
                               warn=lambda line: click.secho(line, fg="yellow", err=True))
    except mon.OptionRefused as e:
        raise click.BadParameter(str(e), param_hint=e.option) from None
    except mon.MonitorUsageError as e:
        raise click.UsageError(str(e)) from None
    except mon.MonitorError as e:
        raise click.ClickException(str(e)) from None
    if ending is not None:  # a signal's 128 + n, a closed stdout's 141: raised once the rig is closed
        raise ending


# --- control: power-limit and clock restore ------------------------------------------------


@main.command()
@simulate_option
@click.option(
    "--restore-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Restore from this file instead of every restore file in the state folder.",
)
@click.option(
    "--force-default",
    is_flag=True,
    help="For a restore file that is damaged or not written by this user: set the GPUs it names to their "
    "default power limit, release clock locks, and remove it.",
)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def restore(simulate: str | None, restore_file: Path | None, force_default: bool, as_json: bool) -> None:
    """Put back every power limit and clock lock a crashed or killed powerprof left changed.

    Exits 1 when anything could not be restored."""
    import json

    from powerprof.rig import Rig

    # A damaged file may name any of several simulated GPUs; the real NVML has what it has.
    with Rig(simulate, sim_gpu_count=8 if force_default else None) as rig:
        report = rig.restore(restore_file)
        if force_default:
            report = rig.force_default(report)
    if as_json:
        click.echo(_json_text(report.to_dict(), indent=2))
    else:
        for line in report.lines():
            click.echo(line, err=not report.ok)
    if not report.ok:
        sys.exit(1)


@main.command()
@click.option("--daemon-metrics", "metrics_url", metavar="URL", required=True,
              help="The daemon's /metrics on loopback, e.g. http://127.0.0.1:9464/metrics (read as untrusted input; "
                   "other hosts, redirects and proxies are refused).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="TOML file with a [tuner] section (as root: owned by root, not group/world-writable).")
@click.option("--levels", default=None, help="Allowed levels, e.g. 180,200,220,240,260,280,300W or 60%,80%,100% (overrides the file).")
@click.option("--reference", default=None,
              help="Reference level, one of --levels, in watts or their form (250, 250W, 80%; default: the highest).")
@click.option("--tpot-p95-ms", type=_FloatRange(min=0, min_open=True), default=None, help="SLO: TPOT p95 in ms.")
@click.option("--ttft-p95-ms", type=_FloatRange(min=0, min_open=True), default=None, help="SLO: TTFT p95 in ms.")
@click.option("--gpus", callback=_parse_gpus, help="NVML indexes to tune together (default: 0).")
@click.option("--dry-run", is_flag=True, help="Only recommend: change nothing, record what would be done.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Decisions dataset folder (default: <state dir>/tuner).")
@click.option("--duration", "duration_s", type=_FloatRange(min=0, min_open=True), default=None,
              help="Stop after this many seconds (default: run until SIGTERM/SIGINT).")
@click.option("--metrics-port", type=_IntRange(0, 65535), default=None,
              help="Serve the tuner's own /metrics on 127.0.0.1:PORT.")
@click.option("--resume", is_flag=True, help="Clear a kill switch persisted by SIGUSR1 and tune again.")
@simulate_option
def tune(metrics_url, config_path, levels, reference, tpot_p95_ms, ttft_p95_ms, gpus, dry_run, out_dir, duration_s,
         metrics_port, resume, simulate):
    """Find and hold the power-limit sweet spot on live traffic under a latency SLO (docs/tuner.md).

    Reads the daemon's /metrics every tick; sets levels through the controller (the original limit
    comes back on every exit; `powerprof restore` after kill -9). SIGUSR1: back to the reference and
    hold, persisted until `tune --resume`."""
    # SIGUSR1 is the kill switch from here on (and from powerprof.entry's recorder before, whose catch it takes on): by
    # default it would end the process, and systemd would restart it tuning, the kill lost.
    from powerprof.tuner.runner import KillSwitch

    early_kill = KillSwitch()
    early_kill.install()

    from powerprof import termination
    from powerprof.control.errors import ControlError
    from powerprof.paths import state_dir
    from powerprof.rig import Rig
    from powerprof.tuner import session
    from powerprof.tuner.runner import OutDirError

    def say(line: str) -> None:
        click.echo(line, err=True)

    try:
        table = session.read_settings(metrics_url, config_path, levels=levels, reference=reference,
                                      tpot_p95_ms=tpot_p95_ms, ttft_p95_ms=ttft_p95_ms, dry_run=dry_run)
    except session.TuneUsageError as e:
        raise click.UsageError(str(e)) from None
    gpus = gpus or [0]
    default_out = out_dir is None
    out_dir = out_dir if out_dir is not None else state_dir() / "tuner"

    with Rig(simulate, gpus=gpus) as rig:
        # Everything the user gave is checked before a controller opens (exit 2, nothing changed, no restart loop).
        try:
            run = session.prepare(rig, table, metrics_url=metrics_url, gpus=gpus, out_dir=out_dir,
                                  default_out=default_out, metrics_port=metrics_port, resume=resume,
                                  early_kill=early_kill, say=say)
        except session.TuneUsageError as e:
            raise click.UsageError(str(e)) from None
        except session.TuneRefused as e:
            raise click.ClickException(str(e)) from None
        try:
            run.run(duration_s)
        except ControlError as e:
            click.echo(f"Error: {e}", err=True)
            sys.exit(1)
        except OutDirError as e:
            # A day folder of --out refused (planted, or made writable by others, while the tuner ran) or not writable
            # (a full disk): the controller has put the originals back; exit 2 as for a bad --out at start (systemd
            # does not retry: RestartPreventExitStatus=2).
            click.echo(f"Error: {e}; the original limits are back", err=True)
            sys.exit(2)
        except OSError as e:
            # Anything else the system refused (a traceback before); the controller has put the originals back.
            from powerprof.errtext import error_text

            click.echo(f"Error: {error_text(e)}; the original limits are back", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            # The controller has put the originals back by now; click's bare "Aborted!" exit 1 read as a failure
            # (and broke the 128+signal every other stop gives).
            click.echo("interrupted: the original limits are back", err=True)
            sys.exit(130)
        except termination.Terminated as e:
            # SIGTERM, SIGHUP, SIGQUIT... (the controller's handler): the originals are back by now; say so, as Ctrl-C
            # does (SIGQUIT once ended the tuner silently with the GPU capped).
            click.echo(f"{_stopped_how(e)}: the original limits are back", err=True)
            raise
    if run.caught:
        sys.exit(128 + run.caught[0])


# Options measure and sweep share: one definition, one default.
_WORKLOAD_OPTIONS = [
    click.option("--api", default=None, type=click.Choice(API_NAMES),
                 help="Protocol the requests use (default: detected from the server)."),
    click.option("--max-tokens", type=_IntRange(2, TRACE_MAX_TOKENS), default=DEFAULT_MAX_TOKENS, show_default=True,
                 help="Tokens generated per request (ignore-EOS where the server supports it)."),
    click.option("--prompts", "prompts_file", default=None, type=click.Path(dir_okay=False),
                 help='JSONL prompt file, one {"prompt": ...} per line (default: the built-in --prompt-set).'),
    click.option("--prompt-set", type=click.Choice(PROMPT_SET_NAMES), default="short", show_default=True,
                 help="Built-in prompts: short, medium, long, or mixed (some of each)."),
    click.option("--prompt-cache/--no-prompt-cache", default=False, show_default=True,
                 help="Let llama.cpp reuse cached prompt prefixes."),
    click.option("--seed", type=_Int(), default=42, show_default=True, help="Sampling seed sent with every request."),
    click.option("--keep-text", is_flag=True, help="Store prompt and completion text in windows.parquet (default: not)."),
    click.option("--launch-timeout", type=_FloatRange(1), default=300.0, show_default=True,
                 help="Seconds to wait for the --launch'ed server's /health."),
]


def _workload_options(f):
    for o in reversed(_WORKLOAD_OPTIONS):
        f = o(f)
    return f


# --- workload: measure (inference-server clients, simulated server, launcher) ------------------


def _server_url(ctx, param, value):
    """--server checked before anything starts: with --launch, a URL without http:// waited out the
    whole --launch-timeout (300 s) for a /health that could never answer."""
    if value is None:
        return value
    from powerprof.workload.client import url_problem

    bad = url_problem(value.rstrip("/"))
    if bad is not None:
        raise click.BadParameter(bad)
    return value


def _int_list(ctx, param, value: str) -> list[int]:
    items = [v.strip() for v in value.split(",")]
    # "1,,4" passed as 1,4 and "4,4" measured concurrency 4 twice into one pooled row: a typo either way.
    if "" in items:
        raise click.BadParameter(f"empty item in {value!r}; expected comma-separated integers like 1,4")
    try:
        out = [int(v) for v in items]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers like 1,4 — got {value!r}") from None
    if any(v < 1 for v in out):
        raise click.BadParameter("every concurrency must be at least 1")
    if big := [v for v in out if v > MAX_CONCURRENCY]:
        raise click.BadParameter(f"{big[0]} in {value!r}: a concurrency is at most {MAX_CONCURRENCY} streams at once")
    dup = sorted({v for v in out if out.count(v) > 1})
    if dup:
        raise click.BadParameter(f"{', '.join(map(str, dup))} given twice in {value!r}; give each concurrency once")
    return out


@main.command()
@click.option("--server", "url", metavar="URL", help="Inference server base URL, e.g. http://127.0.0.1:8080.", callback=_server_url)
@simulate_option
@_server_gpus_option
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Output directory (default runs/<time>-measure).")
@click.option("--requests", "n_requests", type=_IntRange(1), default=8, show_default=True, help="Measured requests per concurrency (rounded up to whole batches of its streams).")
@click.option("--concurrency", default="1", callback=_int_list, show_default=True,
              help=f"Streams at once, e.g. 1,4 (each 1-{MAX_CONCURRENCY}).")
@click.option("--warmup", type=_IntRange(0), default=1, show_default=True,
              help="Warm-up requests at each concurrency, sent as its batches are (rounded up to whole batches; "
                   "recorded, flagged, not counted).")
@click.option("--launch", metavar="CMD", help="Start the server with CMD, wait for /health, stop it at the end.")
@_workload_options
@_allow_unmeasured_option
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def measure(url, simulate, gpus, out_dir, n_requests, concurrency, warmup, launch, api, max_tokens, prompts_file, prompt_set,
            prompt_cache, seed, keep_text, launch_timeout, as_json,
            allow_unmeasured_server_gpus):
    """J/token and decode tok/s at the current settings. Changes nothing; needs no root."""
    import sys
    from pathlib import Path

    from powerprof.storage.runs import default_run_dir, given_out_problem
    from powerprof.workload.client import RequestParams, ServerUnreachable
    from powerprof.workload.launcher import LaunchError
    from powerprof.workload.load import PromptFileError, builtin_prompts, load_prompts
    from powerprof.workload.measure import run_measure
    from powerprof.workload.placement import GpuPlacementError, GpuPlacementStop

    if bool(url) == bool(simulate):
        raise click.UsageError("give exactly one of --server URL or --simulate")
    if launch and not url:
        raise click.UsageError("--launch needs --server URL (where the launched server will listen)")
    try:
        prompts = load_prompts(prompts_file) if prompts_file else builtin_prompts(prompt_set)
    except PromptFileError as e:
        raise click.UsageError(str(e)) from None
    out = Path(out_dir) if out_dir else default_run_dir(Path("runs"), "measure")
    if (why := given_out_problem(out, default=not out_dir)) is not None:
        raise click.UsageError(why)
    params = RequestParams(max_tokens=max_tokens, seed=seed, prompt_cache=prompt_cache, keep_text=keep_text)
    from powerprof import termination

    # SIGTERM's default action killed it where it stood: the empty --out folder stayed, and no word was said.
    # (A --launch server's launcher sets its own handlers over these, and stops the server in them.)
    try:
        # An index or UUID that names no GPU is a usage error (exit 2), as sweep's --gpus: said before anything starts.
        with _signals_raise(), _open_rig_or_exit(simulate, gpus, host=False) as rig:
            res = run_measure(rig, url=url, out_dir=out, prompts=prompts, n_requests=n_requests,
                              concurrencies=concurrency, params=params, warmup=warmup, api=api, launch=launch,
                              launch_timeout_s=launch_timeout, command_line=" ".join(sys.argv),
                              default_out=not out_dir, allow_unmeasured_server_gpus=allow_unmeasured_server_gpus)
    except GpuPlacementStop as e:
        # Found by the look under load, once measuring had begun: a stop partway, said as sweep's is (PlacementStop),
        # exit 2 without the usage banner.
        exc = click.ClickException(str(e))
        exc.exit_code = 2
        raise exc from None
    except GpuPlacementError as e:  # the GPUs measured, given or left out, miss one the server runs on (sweep's too)
        raise click.UsageError(str(e)) from None
    except (ServerUnreachable, LaunchError, FileExistsError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except (KeyboardInterrupt, termination.Terminated) as e:
        # Stopped before any measured request had finished (during start-up, warm-up or the first batch), or before
        # the look under load had checked the first batch: a stop later keeps the finished batches and is reported by
        # MeasureResult.stop_line.
        why = getattr(e, "nothing_kept_why", None) or ("no measured request had finished, or the look at the "
                                                       "server's GPUs after the first batch had not answered")
        _stop_exit(f"{_stopped_how(e)}: nothing was written to {out} ({why}); nothing was changed",
                   130 if isinstance(e, KeyboardInterrupt) else e.code)
    stop_code = None if res.stopped is None else (130 if isinstance(res.stopped, KeyboardInterrupt) else res.stopped.code)
    if as_json:
        click.echo(_json_text(res.to_dict(), indent=2))
        if res.write_error:
            raise click.ClickException(res.write_error)
        if stop_code is not None:
            click.echo(res.stop_line(), err=True)
            sys.exit(stop_code)
        if res.excluded is not None and not any(m.n_trusted for m in res.summaries):
            click.echo(f"Error: no window could be trusted: {res.excluded.message()}", err=True)
            sys.exit(1)
        if res.foreign_traffic is not None and not any(m.n_trusted for m in res.summaries):
            click.echo(f"Error: {res.all_foreign()}", err=True)
            sys.exit(1)
        if res.aborted:
            sys.exit(1)
        return
    for line in res.lines():
        click.echo(line)
    if res.write_error:
        raise click.ClickException(res.write_error)
    click.echo(f"windows: {res.out_path / 'windows.parquet'}")
    if stop_code is not None:
        if res.excluded is not None:
            click.echo(f"warning: {res.excluded.message()}", err=True)
        click.echo(res.stop_line(), err=True)
        sys.exit(stop_code)
    if res.aborted:
        if not any(m.n_ok for m in res.summaries):
            raise click.ClickException(f"stopped early: {res.aborted}; no request succeeded, so nothing was measured "
                                       f"(the failed attempts are recorded in {res.out_path})")
        raise click.ClickException(f"stopped early: {res.aborted} (what was measured is in {res.out_path})")
    if res.excluded is not None:
        if not any(m.n_trusted for m in res.summaries):
            raise click.ClickException(f"no window could be trusted: {res.excluded.message()}")
        click.echo(f"warning: {res.excluded.message()}", err=True)
    if res.foreign_traffic is not None and not any(m.n_trusted for m in res.summaries):
        raise click.ClickException(res.all_foreign())


def _load_trace(trace_path, time_scale, duration_s):
    """The trace's requests, scaled and cut to --duration; a usage error when none is left."""
    from powerprof.workload.trace import TraceError, read_trace, shape

    try:
        trace = shape(read_trace(trace_path), time_scale, duration_s)
    except TraceError as e:
        raise click.UsageError(str(e)) from None
    if not trace:
        raise click.UsageError(f"no request of {trace_path} arrives within --duration {duration_s:g} s")
    return trace


@main.command()
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option("--server", "url", metavar="URL", help="Inference server base URL.", callback=_server_url)
@simulate_option
@click.option("--launch", metavar="CMD", help="Start the server with CMD, wait for /health, stop it at the end.")
@click.option("--api", type=click.Choice(API_NAMES), default=None, help="Protocol the requests use (default: detected).")
@click.option("--time-scale", type=_FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Divide the trace's arrival times by this (2 = twice as fast).")
@click.option("--duration", "duration_s", type=_FloatRange(min=0, min_open=True), default=None,
              help="Replay only the requests arriving in the first this many seconds (after scaling).")
@click.option("--tag-header", default="X-Powerprof-Tag", show_default=True, callback=_tag_header_option,
              help="Header carrying a record's tag: an HTTP header name of your own (not Host, Content-Length, "
                   "Authorization, Cookie or another HTTP or the server needs).")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def replay(trace_path, url, simulate, launch, api, time_scale, duration_s, tag_header, as_json):
    """Drive a server with a trace's arrival times and token counts (Azure CSV or JSONL); latency and throughput."""
    from powerprof import termination
    from powerprof.rig import Rig
    from powerprof.workload.client import ServerUnreachable
    from powerprof.workload.launcher import LaunchError
    from powerprof.workload.replay import TraceReplay

    if bool(url) == bool(simulate):
        raise click.UsageError("give exactly one of --server URL or --simulate")
    if launch and not url:
        raise click.UsageError("--launch needs --server URL: where the launched server will listen")
    trace = _load_trace(trace_path, time_scale, duration_s)
    rp = TraceReplay(trace, api, tag_header, say=lambda line: click.echo(line, err=True))
    try:
        with _signals_raise(), Rig(simulate, host=False) as rig, rig.server(url, launch) as base:
            rp.run(base)
    except (ServerUnreachable, LaunchError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except (KeyboardInterrupt, termination.Terminated) as e:
        # Click turned Ctrl-C into "Aborted!" and exit 1, and every finished request's figures were lost.
        rp.stopped = e
        if not rp.finished_any():
            _stop_exit(f"{_stopped_how(e)} before any request finished: nothing to report",
                       130 if isinstance(e, KeyboardInterrupt) else e.code)
    report = rp.report()
    if as_json:
        click.echo(_json_text(report.to_dict(), indent=2))
    else:
        for line in report.lines():
            click.echo(line)
    if report.stopped is not None:
        click.echo(report.stopped_line(_stopped_how(report.stopped)), err=True)
        sys.exit(130 if isinstance(report.stopped, KeyboardInterrupt) else report.stopped.code)
    if (why := report.error()) is not None:
        raise click.ClickException(why)


@main.command("trace")
@click.argument("out_path", metavar="OUT.jsonl", type=click.Path(dir_okay=False))
@click.option("--requests", "n", type=_IntRange(1, 10_000_000), default=1000, show_default=True,
              help="Requests in the trace.")
@click.option("--rate", "rate", type=_FloatRange(min=0, min_open=True), default=5.0, show_default=True, help="Requests per second on average.")
@click.option("--arrivals", type=click.Choice(["poisson", "bursty"]), default="poisson", show_default=True,
              help="Poisson arrivals, or Poisson bursts of about 8 requests within 50 ms.")
@click.option("--prompt-median", type=_FloatRange(1), default=400.0, show_default=True, help="Median prompt tokens (lognormal).")
@click.option("--output-median", type=_FloatRange(1), default=80.0, show_default=True, help="Median output tokens (lognormal).")
@click.option("--seed", type=_IntRange(min=0), default=0, show_default=True,
              help="Random seed, a whole number 0 or more (the same seed gives the same trace).")
@click.option("--max-context", type=_IntRange(2, 10_000_000), default=None,
              help="Cut each request's prompt so that prompt + output fit this many tokens: the context the server was "
                   "started with (llama.cpp -c, vLLM --max-model-len). Default: uncut (up to 4096 + 600).")
@click.option("--force", is_flag=True, help="Replace OUT.jsonl if it exists (default: refuse, it may be a real trace).")
def trace_cmd(out_path, n, rate, arrivals, prompt_median, output_median, seed, max_context, force):
    """Write a synthetic trace (JSONL) for `replay`: Poisson or bursty arrivals, lognormal lengths."""
    from powerprof.workload.trace import synthetic, write_jsonl

    from powerprof.paths import TEMP_NAME_BYTES, cwd_joined, output_file_refusal
    from powerprof.storage.runs import missing_parent

    # A relative one from a removed current folder (os.getcwd()'s traceback), or a missing folder ("folder 'x' does not
    # exist", exit 2): in every command's words (missing_parent). One file, written under its temporary name.
    if (why := missing_parent(out_path, "OUT.jsonl", TEMP_NAME_BYTES)) is not None:
        raise click.UsageError(why)
    out = Path(out_path)
    # lstat, not exists(): a looping symlink was replaced without --force; a FIFO or device is refused even with it.
    if (why := output_file_refusal(out_path, force, "a trace of yours?")) is not None:
        raise click.BadParameter(why, param_hint="OUT.jsonl")
    from powerprof.trust import out_dir_refusal

    # As root, the folder too, as monitor --output's: through another user's symlinked folder root wrote anywhere.
    if (why := out_dir_refusal(cwd_joined(out_path).parent, "folder", "OUT.jsonl")) is not None:
        raise click.BadParameter(why, param_hint="OUT.jsonl")
    from powerprof.workload.trace import COMMON_CONTEXT_TOKENS, MAX_SPAN_S

    # The mean span first: `--rate 1e-300` wrote arrivals 1e300 s apart, which replay and sweep --trace then refused.
    if not n / rate <= MAX_SPAN_S:  # the bound itself: at half of it, a span that fits was refused as past it
        raise click.BadParameter(f"{rate:g} requests/s spreads {n} requests over about {n / rate:g} s, more than a replay "
                                 f"takes ({MAX_SPAN_S:g} s): give a higher rate", param_hint="--rate")
    tr = synthetic(n, rate, arrivals, prompt_median=prompt_median, output_median=output_median, seed=seed,
                   max_context=max_context)
    if not tr[-1].t_s <= MAX_SPAN_S:  # a draw past the mean
        raise click.BadParameter(f"the arrivals drawn span {tr[-1].t_s:g} s, more than a replay takes ({MAX_SPAN_S:g} s): "
                                 "give a higher rate", param_hint="--rate")
    try:
        write_jsonl(tr, out)
    except OSError as e:
        raise click.BadParameter(f"cannot write {out_path}: {e.strerror or e}", param_hint="OUT.jsonl") from None
    click.echo(f"{out_path}: {len(tr)} requests over {tr[-1].t_s:.1f} s")
    need = [r.prompt_tokens + r.output_tokens for r in tr]
    if max_context is None and max(need) > COMMON_CONTEXT_TOKENS:
        # A replay against llama.cpp's -c 4096 ended "2 of 200 requests failed: HTTP 400 ... exceeds the context".
        click.echo(f"note: {sum(x > COMMON_CONTEXT_TOKENS for x in need)} request(s) need more than "
                   f"{COMMON_CONTEXT_TOKENS} tokens of context (prompt + output, up to {max(need)}): a server started "
                   f"with less refuses them; --max-context N cuts their prompts to fit")


# --- analysis: analyze, export ----------------------------------------------------------------


FRACTION_RULE = "a percentage (10%) or a fraction (0.1); a bare number is a fraction below 1, so write 5% for five percent"


def _fraction(text: str, rule: str) -> float:
    """'10%' or '0.1' → 0.1. A bare number is a fraction and must be below 1: one of 1 or more is refused, with the
    percentage it may mean (it was read as a percent above 1 and a fraction at or below: `1` refused, `1.5` 1.5%, `0.5`
    50%). Every message quotes the user's own text (`1e9` said "got 1e+07"). `rule`: the range, as the message says it."""
    t = str(text).strip()
    pct = t.endswith("%")
    try:
        v = float(t[:-1].strip() if pct else t)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a fraction or percentage (e.g. 10% or 0.1)") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise click.BadParameter(f"{text!r} is not a finite fraction or percentage (e.g. 10% or 0.1)")
    if not pct and v >= 1:
        raise click.BadParameter(f"{text!r}: must be {rule}; a bare number is a fraction below 1 (0.1 is 10%): for "
                                 f"{t} percent write {t}%")
    return v / 100 if pct else v


def _max_slowdown_option(ctx, param, value):
    """--max-slowdown of `sweep` and `analyze` alike, by the analysis' own rule (check_max_slowdown)."""
    from powerprof.analysis.sweetspot import check_max_slowdown

    rule = "from 0 up to, not including, 100% (e.g. 10% or 0.1)"
    v = _fraction(value, rule)
    try:
        return check_max_slowdown(v)
    except ValueError:  # its message says the number as a fraction ("got 1.5" for 150%): the user's text instead
        raise click.BadParameter(f"{value!r}: max slowdown must be {rule}") from None


def _formats_option(ctx, param, value):
    """--format of `analyze`: one or more of the report formats; an empty list would write no report and say nothing."""
    from powerprof.analysis.report import FORMATS

    fmts = tuple(dict.fromkeys(f.strip() for f in value.split(",") if f.strip()))
    bad = [f for f in fmts if f not in FORMATS]
    if bad or not fmts:
        what = f"unknown report format(s) {', '.join(bad)}" if bad else f"{value!r} names no report format"
        raise click.BadParameter(f"{what}; choose one or more of {', '.join(FORMATS)} (e.g. md,html)")
    return fmts


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=str)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for the report, plots and analysis.parquet (default: RUN_DIR/analysis); "
                   "for daemon datasets, the folder for fleet.parquet (default: none written).")
@click.option("--max-slowdown", default="10%", show_default=True, callback=_max_slowdown_option,
              help="Slowdown budget for the recommended limit, vs the reference level: " + FRACTION_RULE + ".")
@click.option("--eta", type=_FloatRange(0, 1), default=0.5, show_default=True,
              help="Weight of energy in the weighted-cost policy eta*E + (1-eta)*Pmax/T (1: energy only).")
@click.option("--format", "formats", default="md,html", show_default=True, callback=_formats_option,
              help="Report formats: md, html or both.")
@click.option("--force", is_flag=True, help="Pool runs even if what they measured differs (GPU model or count, server, traffic, "
              "request settings, energy method), each difference warned about.")
@click.option("--bootstrap", "n_boot", type=_IntRange(100, 100_000), default=2000, show_default=True,
              help="Bootstrap resamples for the confidence intervals.")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP + " The same as analysis.json.")
def analyze(run_dirs, out_dir, max_slowdown, eta, formats, force, n_boot, as_json):
    """Curve fits, sweet spot under several policies, report (Markdown/HTML) and PNG plots.

    RUN_DIRS are sweep run folders or globs of them. Daemon data folders (several nodes'; globs;
    s3://, gs://, https:// URIs) get the per-host fleet summary instead (docs/fleet.md)."""
    from powerprof.analysis import fleet
    from powerprof.analysis.loading import AnalysisError
    from powerprof.analysis.report import AnalysisOutRefused, AnalysisOutTaken, analyze_run, console_summary

    try:
        sources = fleet.expand_sources(run_dirs)
        if all(fleet.is_daemon_dataset(s) for s in sources):
            table = fleet.fleet_summary(sources)
            tags = fleet.tag_summary(sources)  # per tag name: empty where no tag was ever stopped
            said = [n for n in (fleet.empty_note(sources), fleet.stray_note(sources)) if n] + fleet.notes(table) + fleet.tag_notes(tags)
            said = list(dict.fromkeys(said))  # a note both tables carry (samples unreadable) said once
            if out_dir is not None:
                from powerprof.paths import holds_dataset_tables, holds_sweep_run, path_problem
                from powerprof.storage.runs import cwd_gone, missing_parent
                from powerprof.trust import out_dir_refusal

                if (why := cwd_gone(out_dir)) is not None:  # said first, not as root's "cannot inspect"
                    raise AnalysisOutRefused(why)
                if (why := path_problem(out_dir)) is not None:  # an OSError traceback from out_taken's exists()
                    raise AnalysisOutRefused(f"--out {out_dir}: {why}")
                if (why := out_dir_refusal(Path(out_dir), "folder")) is not None:  # as root: root's or the sudo user's
                    raise fleet.FleetError(why)
                if holds_sweep_run(out_dir):  # export of the run would show fleet.parquet as one of its tables
                    raise AnalysisOutTaken(f"--out {out_dir} is a sweep's run directory: fleet.parquet would lie among "
                                           "its tables, read as that run's; give another folder with --out")
                if holds_dataset_tables(out_dir):
                    # A table beside a daemon's dataset folders made `export` of that folder read it alone, the
                    # requests, intervals and samples left out unsaid.
                    raise AnalysisOutTaken(f"--out {out_dir} holds a daemon's datasets: fleet.parquet beside them would "
                                           "make `export` of that folder read it in their stead; give another folder "
                                           "with --out")
                if (above := fleet.dataset_above(out_dir)) is not None:
                    # Its requests/ read fleet.parquet's row as one more request: 11 at 6.250 J/token, not 10 at 0.500.
                    raise AnalysisOutTaken(f"--out {out_dir} is inside the daemon dataset {above}: fleet.parquet there "
                                           "would be read as its rows, or as one more table of it; give another "
                                           "folder with --out")
                if (why := fleet.out_taken(Path(out_dir))) is not None:  # a person's file of the summary's name
                    raise AnalysisOutTaken(why)
                if (why := missing_parent(out_dir)) is not None:
                    raise AnalysisOutRefused(why)
                try:
                    fleet.write_out(Path(out_dir), table, tags)
                except OSError as e:  # a full disk, a read-only folder: a traceback before
                    raise fleet.FleetError(f"cannot write the fleet summary to {out_dir}: {e.strerror or e}"
                                           + (f" ({e.filename})" if e.filename else "")) from None
            if as_json:
                # One object: the hosts, the tags and the notes that say what was left out of their figures.
                click.echo(_json_text({"hosts": table.to_pylist(), "tags": tags.to_pylist(),
                                       "notes": said}, default=str, indent=2))
            else:
                click.echo(fleet.render_summary(table))
                if tags.num_rows:
                    click.echo("\n" + fleet.render_tags(tags))
            for n in said:
                click.echo(f"note: {n}", err=True)
            return
        if any(fleet.is_uri(s) for s in sources):
            raise AnalysisError("sweep runs are read from local folders; object-store URIs are for daemon datasets")
        if any(fleet.is_daemon_dataset(s) for s in sources):
            from powerprof.analysis.loading import read_run_info

            for s in sources:  # one that is no run at all is named, not the dataset beside it (refused after)
                if not fleet.is_daemon_dataset(s):
                    read_run_info(s)
            # The text `export` gives the same mix (one refusal for both commands).
            raise AnalysisError(fleet.dataset_beside_run(next(s for s in sources if fleet.is_daemon_dataset(s)),
                                                         [s for s in sources if not fleet.is_daemon_dataset(s)],
                                                         "analyze"))
        result = analyze_run(sources, out_dir, max_slowdown=max_slowdown, eta=eta, formats=formats,
                             force=force, n_boot=n_boot)
    except AnalysisOutTaken as e:  # said as an output file that exists (export --out, monitor --output)
        raise click.BadParameter(str(e), param_hint="--out") from None
    except AnalysisOutRefused as e:  # a usage error, as every command's --out that names no place (missing_parent)
        raise click.UsageError(str(e)) from None
    except (AnalysisError, fleet.FleetError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        # click's bare "Aborted!" (exit 1) read like a failure of the analysis itself.
        _stop_exit("interrupted: the analysis did not finish (the runs are untouched); run it again for the report", 130)
    for n in result.write_notes:  # on stderr: `--json`'s stdout is the analysis alone
        click.echo(f"note: {n}", err=True)
    if as_json:
        from powerprof.analysis.report import result_json

        # The JSON carries it in `warnings`; a pipe reading stdout would never show it to the person.
        for w in result.warnings:
            if w.kind == "forced-pool":
                click.echo(f"warning: {w.message}", err=True)
        click.echo(result_json(result))
        return
    from powerprof.progress import result_console

    # Wrapped to the width sweep's results get (a pipe: 120 unless $COLUMNS): the terminal's own wrap cut figures.
    click.echo(console_summary(result, width=result_console().width))
    for n in result.notes:  # not in console_summary: the sweep's end screen has said them already
        click.echo(f"note: {n}")


@main.command()
@click.argument("src", nargs=-1, required=True, type=str)
@click.option("--format", "fmt", type=click.Choice(["csv", "xlsx", "parquet"], case_sensitive=False), required=True,
              help="csv (one file per table), xlsx (one workbook, a summary sheet first) or parquet.")
@click.option("--from", "time_from", default=None, help="Only rows at or after this ISO 8601 time (local unless it has an offset).")
@click.option("--to", "time_to", default=None, help="Only rows before this ISO 8601 time.")
@click.option("--columns", default=None, help="Comma-separated columns to keep (default: all).")
@click.option("--tz", default=None, help="Time zone of the *_local columns and of --from/--to without offset (IANA name; default: this machine's).")
@click.option("--out", default=None, type=click.Path(), help="Output file (xlsx; or one-table csv/parquet) or folder (default: in this folder, SRC's "
              "name with .xlsx, -csv or -parquet; export.xlsx etc. for several SRC).")
@click.option("--force", is_flag=True, help="Replace the files --out names or holds if they exist (default: refuse, "
              "they may be an earlier export).")
def export(src, fmt, time_from, time_to, columns, tz, out, force):
    """Spreadsheet-ready CSV, xlsx or Parquet from run directories or daemon datasets.

    SRC: one or more run directories, daemon data folders (several nodes' export as one table
    each, rows carry `host`), .parquet files, globs, or URIs (s3://, gs://, abfs://, file://)."""
    from powerprof.analysis.export import ExportError, ExportOutExists, ExportUsageError, export as run_export

    # `--columns ''` and `--columns ,,` name no column: an empty list, refused (they exported every column).
    cols = [c.strip() for c in columns.split(",") if c.strip()] if columns is not None else None
    notes: list[str] = []
    try:
        paths = run_export(list(src), fmt, out, time_from, time_to, cols, tz, notes=notes, force=force)
    except ExportOutExists as e:  # said as monitor --output and trace say theirs
        if e.default:  # no --out was given: "Invalid value for --out" named an option the user never typed
            raise click.UsageError(str(e)) from None
        raise click.BadParameter(str(e), param_hint="--out") from None
    except ExportUsageError as e:  # an option as given cannot be used: exit 2, as click's own option errors
        raise click.UsageError(str(e)) from None
    except ExportError as e:
        raise click.ClickException(str(e)) from None
    for p in paths:
        click.echo(str(p))
    for n in notes:
        click.echo(f"note: {n}", err=True)


# --- sweep -------------------------------------------------------------------------------------


def _fraction_option(ctx, param, value):
    if value is None:
        return None
    v = _fraction(value, "between 0 and 100%")
    if not 0 < v < 1:
        raise click.BadParameter(f"{value!r} must be between 0 and 100%")
    return v


@main.command()
@click.option("--limits", "limits", default=None, callback=_levels_option("power limits", "180,220W,60%"),
              help="Power limits to step through: 180,220W,60% (of the default).")
@click.option("--clocks", "clocks", default=None, callback=_levels_option("SM clocks in MHz", "1500,1200MHz,80%"),
              help="Locked SM clocks (MHz) to step through instead of power limits.")
@click.option("--server", "url", default=None, help="Inference server base URL (llama.cpp, vLLM, SGLang, OpenAI-compatible).", callback=_server_url)
@click.option("--launch", default=None, help="Start the server with this command (needs --server for its URL); stopped at the end. "
              "With --vary, a template: {NAME} takes each value of --vary NAME=...")
@click.option("--vary", multiple=True, metavar="NAME=V1,V2,...",
              help="A server knob to sweep through the --launch template (repeatable; every combination is launched once).")
@click.option("--context-tokens", default=None, metavar="N,N,...",
              help="Context lengths to measure, e.g. 512,8k,32k: prompts of that many tokens, counted by the server's /tokenize.")
@simulate_option
@_server_gpus_option
@click.option("--repeats", default=1, show_default=True, type=_IntRange(1, 100), help="Passes over all levels, interleaved.")
@click.option("--order", default="desc", show_default=True, type=click.Choice(["desc", "asc", "random"]),
              help="Order of the levels in each pass: high to low, low to high, or shuffled.")
@click.option("--target-ci", default="2%", show_default=True, callback=_fraction_option,
              help="Stop a level when the 95% CI half-width of J/token is within this share of the median (2% or "
                   "0.02; a bare number is a fraction below 1).")
@click.option("--target-paired-ci", default=None, callback=_fraction_option,
              help="Also stop a level once its energy saving vs the reference is known within this (0.5%: ±0.5 percentage point), paired by prompt.")
@click.option("--min-requests", default=5, show_default=True, type=_IntRange(2, 10000),
              help="Measured requests per level before the CI target may stop it.")
@click.option("--max-requests", default=200, show_default=True, type=_IntRange(2, 100000),
              help="Measured requests per level at most, rounded up to whole rounds of the prompt set (every level "
                   "measures the same prompts).")
@click.option("--max-time", "max_time_s", default=120.0, show_default=True, type=_FloatRange(1, 86400), help="Seconds of measuring per level (after warm-up) before it stops even short of --target-ci; the round of prompts in progress still finishes.")
@click.option("--warmup", default=2, show_default=True, type=_IntRange(0, 100), help="Warm-up requests per level (discarded), sent --concurrency at a time (rounded up to whole batches).")
@click.option("--idle-s", default=5.0, show_default=True, type=_FloatRange(0, 3600), help="Seconds of idle baseline before the first level.")
@click.option("--concurrency", default=1, show_default=True, type=_IntRange(1, MAX_CONCURRENCY),
              help="Requests in flight at once (streams).")
@click.option("--server-restart-wait", "server_restart_wait_s", default=120.0, show_default=True, type=_FloatRange(0, 86400),
              help="Seconds to wait for a --server that stops answering mid-level (restarted) to be healthy again; the level "
                   "is then measured again from scratch. 0: stop the sweep. Not with --launch (its server exiting has died).")
@_workload_options
@click.option("--interval", "interval_s", default=1.0, show_default=True, type=_FloatRange(0.02, 10), help="Sampling interval in seconds.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False), help="Run directory (default runs/<UTC time>-<gpu>).")
@click.option("--max-slowdown", default="10%", show_default=True, callback=_max_slowdown_option,
              help="Slowdown budget for the recommendation, vs the reference level: " + FRACTION_RULE + ".")
@click.option("--dry-run", is_flag=True, help="Validate and print the plan; touch nothing.")
@click.option("--trace", "trace_path", default=None, type=click.Path(dir_okay=False),
              help="Replay this trace (Azure CSV or JSONL) at each level instead: J/token and latency for that traffic mix.")
@click.option("--time-scale", type=_FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="With --trace: divide its arrival times by this.")
@click.option("--duration", "duration_s", type=_FloatRange(min=0, min_open=True), default=None,
              help="With --trace: replay only the requests arriving in the first this many seconds.")
@_allow_unmeasured_option
def sweep(limits, clocks, url, launch, vary, context_tokens, simulate, gpus, repeats, order, target_ci, target_paired_ci, min_requests, max_requests, max_time_s,
          warmup, idle_s, concurrency, server_restart_wait_s, api, max_tokens, prompts_file, prompt_set, prompt_cache, seed,
          keep_text, launch_timeout, interval_s, out_dir, max_slowdown, dry_run, trace_path, time_scale, duration_s,
          allow_unmeasured_server_gpus):
    """Step the GPU power limit (or locked SM clock) across levels; J/token and speed loss per level."""
    from rich.text import Text

    from powerprof.pipes import EXIT_PIPE
    from powerprof.progress import QuietPipeConsole, RichSweepUI, end_screen, levels_table, result_console
    from powerprof.rig import Rig
    from powerprof.sweep import SweepSettings, run_sweep
    from powerprof.workload.client import RequestParams
    from powerprof.workload.load import PromptFileError, builtin_prompts, load_prompts

    from powerprof.grid import GridSpec, parse_vary, run_grid
    from powerprof.workload.context import parse_context_tokens

    grid = None
    if vary or context_tokens:
        try:
            grid = GridSpec(launch, tuple(parse_vary(vary)),
                            tuple(parse_context_tokens(context_tokens)) if context_tokens else ())
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    if limits and clocks or not (limits or clocks or grid):
        raise click.UsageError("give exactly one of --limits or --clocks (optional with --vary or --context-tokens)")
    if launch and not url:
        raise click.UsageError("--launch needs --server URL: where the launched server will listen")
    if not (url or simulate):
        # --simulate with --server: a simulated GPU beside a real server (every output says so);
        # --simulate with --launch: the simulated GPU, driven by a launched `python -m powerprof.sim.serve`.
        raise click.UsageError("give --server URL (with --launch CMD to start it), --simulate, or --simulate with --server URL "
                               "(a simulated GPU beside a real server)")
    if max_requests < min_requests:
        raise click.UsageError("--max-requests must not be below --min-requests")
    from click.core import ParameterSource

    if launch and click.get_current_context().get_parameter_source("server_restart_wait_s") is not ParameterSource.DEFAULT:
        raise click.UsageError("--server-restart-wait is not used with --launch: a launched server that exits has died "
                               "(it is powerprof's own child), and the sweep stops and says so")
    _check_trace_options(click.get_current_context(), trace_path)
    if trace_path:
        _trace_sweep(trace_path, time_scale, duration_s, limits, clocks, url, launch, simulate, gpus, api, interval_s,
                     launch_timeout, out_dir, idle_s, dry_run, repeats, order, allow_unmeasured_server_gpus)
        return
    try:
        prompts = load_prompts(prompts_file) if prompts_file else builtin_prompts(prompt_set)
    except PromptFileError as e:
        raise click.UsageError(str(e)) from None
    out = result_console()
    try:
        # What the progress bar measures against: the same stopping rule the sweep applies.
        bar_rule = SweepSettings(level_kind="power_limit", levels=(1.0,), min_requests=min_requests,
                                 max_requests=max_requests, max_time_s=max_time_s, target_ci=target_ci,
                                 concurrency=concurrency)  # without it, a --concurrency 4 level's batches read "req"
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    # A closed pipe (`2>&1 | head`) silences the progress, not the sweep: it finishes, then exits 141.
    err = QuietPipeConsole(stderr=True)
    if not err.is_terminal and not os.environ.get("COLUMNS"):
        err = QuietPipeConsole(stderr=True, width=120)  # as result_console: 80 cut a finished line's time to "0:0…"
    ui = RichSweepUI(err, bar_rule)
    with _sweep_exits(dry_run, clocks=bool(clocks)) as seen:
        with ui, Rig(simulate, gpus=gpus) as rig:
            seen.rig = rig
            kind = "power_limit" if limits else "sm_clock" if clocks else "none"
            common = dict(levels_spec=limits or clocks or "", level_kind=kind, url=url)
            if grid is not None:
                sweep_fn = lambda rig, **kw: run_grid(rig, grid, **common, **kw)  # noqa: E731
            else:
                sweep_fn = lambda rig, **kw: run_sweep(rig, launch=launch, **common, **kw)  # noqa: E731
            outcome = sweep_fn(
                rig, out_dir=out_dir, prompts=prompts,
                params=RequestParams(max_tokens=max_tokens, seed=seed, prompt_cache=prompt_cache, keep_text=keep_text),
                launch_timeout_s=launch_timeout, api=api, interval_s=interval_s, dry_run=dry_run,
                command_line=" ".join(sys.argv), ui=ui, repeats=repeats, order=order, target_ci=target_ci,
                target_paired_ci=target_paired_ci,
                min_requests=min_requests, max_requests=max_requests, max_time_s=max_time_s, warmup_requests=warmup,
                idle_s=idle_s, concurrency=concurrency, server_restart_wait_s=server_restart_wait_s,
                allow_unmeasured_server_gpus=allow_unmeasured_server_gpus,
            )
    if dry_run:
        for line in outcome.plan_lines:
            out.print(line, markup=False, highlight=False)  # a --launch command's "[x]" is not a style tag
        if out.pipe_closed:
            sys.exit(EXIT_PIPE)
        if outcome.in_use:  # another run holds the GPU: the real one would fail as it starts
            sys.exit(1)
        return
    from powerprof import termination
    from powerprof.analysis.loading import AnalysisError

    unit = "W" if limits else "MHz"
    back = rig.restored_line(clocks=bool(clocks))  # the controller closed with the rig: every GPU is back
    try:
        with _signals_raise():
            for note in outcome.notes:
                out.print(Text.assemble(("note:", "yellow"), f" {note}"))
            from powerprof.analysis.report import analyze_run, console_summary  # scipy, matplotlib: seconds

            result = analyze_run([outcome.run_dir], max_slowdown=max_slowdown)
    except AnalysisError as e:
        if grid is None:
            out.print(levels_table(outcome.levels, unit))
        if back:
            out.print(back, markup=False, highlight=False)
        out.print(f"run directory: {outcome.run_dir}", markup=False, highlight=False)
        out.print(Text.assemble(("analysis failed:", "red"), f" {e}"))
        sys.exit(1)
    except Exception as e:
        # Ctrl-C while DuckDB scans the samples comes back as its error (termination.exit_inside).
        stop = termination.exit_inside(e)
        if stop is None:
            raise
        _analysis_stopped(stop, outcome.run_dir)
    except (KeyboardInterrupt, termination.Terminated) as e:
        _analysis_stopped(e, outcome.run_dir)
    if result.knobs is not None:
        out.print(console_summary(result, width=out.width), highlight=False, markup=False)
    else:
        out.print(end_screen(outcome.levels, result, unit), highlight=False)
    if back:
        out.print(back, markup=False, highlight=False)
    out.print(f"run directory: {outcome.run_dir}", markup=False, highlight=False)
    if out.pipe_closed or ui.console.pipe_closed:
        sys.exit(EXIT_PIPE)


def _analysis_stopped(e: BaseException, run_dir) -> None:
    # Every level finished and is stored: only the report is missing, and it can be made again.
    click.echo(f"{_stopped_how(e)} during the analysis: the run is complete in {run_dir}; "
               f"make its report with: powerprof analyze {run_dir}", err=True)
    sys.exit(130 if isinstance(e, KeyboardInterrupt) else e.code)


# Options only a prompt-set sweep uses, and those only --trace uses: given to the other kind, they would
# be ignored without a word (--duration read as a time limit; a --vary template launched with its {NAME}).
_PROMPT_SWEEP_ONLY = ("vary", "context_tokens", "concurrency", "warmup", "target_ci", "target_paired_ci", "min_requests",
                      "max_requests", "max_time_s", "max_tokens", "prompts_file", "prompt_set", "prompt_cache", "seed",
                      "keep_text", "max_slowdown", "server_restart_wait_s")
_TRACE_ONLY = ("time_scale", "duration_s")


def _check_trace_options(ctx, trace_path) -> None:
    from click.core import ParameterSource

    def given(names):
        opts = {p.name: p.opts[0] for p in ctx.command.params}
        return [opts[n] for n in names if ctx.get_parameter_source(n) not in (ParameterSource.DEFAULT, None)]

    if trace_path:
        bad = given(_PROMPT_SWEEP_ONLY)
        if bad:
            raise click.UsageError(f"not used with --trace (the trace sets the requests, their lengths and arrivals; "
                                   f"each level replays it once per --repeats): {', '.join(bad)}")
    else:
        bad = given(_TRACE_ONLY)
        if bad:
            raise click.UsageError(f"only used with --trace: {', '.join(bad)} (to limit a level's time, use --max-time)")


def _signals_raise():
    """termination.signals_raise, imported when a command uses it (asyncio at every start otherwise)."""
    from powerprof import termination

    return termination.signals_raise()


def _stopped_how(e: BaseException) -> str:
    from powerprof import termination

    return termination.stopped_how(e)


@contextlib.contextmanager
def _sweep_exits(dry_run: bool = False, clocks: bool = False):
    """A sweep's exits: bad input 2, a failure 1 with its message, Ctrl-C 130, SIGTERM/SIGHUP 128 + signal (the GPUs
    are back by then). Yields a namespace whose `rig` the sweep sets: what was changed is said from it."""
    from types import SimpleNamespace

    from powerprof import termination
    from powerprof.control.errors import ControlError
    from powerprof.control.levels import LevelError
    from powerprof.sweep import OutRefused, SweepError
    from powerprof.workload.client import ServerUnreachable
    from powerprof.workload.launcher import LaunchError

    seen = SimpleNamespace(rig=None)

    def back() -> str:
        return _back_line(clocks, changed=seen.rig is not None and seen.rig.changed_gpus)

    try:
        yield seen
    except (LevelError, ValueError) as e:
        if type(e).__module__.startswith("pyarrow"):  # ArrowInvalid is a ValueError, but not the user's mistake
            raise click.ClickException(f"writing the run failed: {e}") from None
        raise click.UsageError(str(e)) from None
    except OutRefused as e:  # before anything started: a usage error, said as every command's --out (missing_parent)
        raise click.UsageError(str(e) if dry_run else f"{e}\n{back()}") from None
    except (SweepError, ServerUnreachable, LaunchError) as e:
        # These reach here after the controller put every GPU back (a failed restore raises a ControlError in their
        # place); a stopped sweep said nothing of the GPU, and the user was left to wonder whether it was capped.
        exc = click.ClickException(str(e) if dry_run else f"{e}\n{back()}")
        exc.exit_code = getattr(e, "exit_code", 1)  # a grid's placement stop: 2, the --gpus the mistake
        raise exc from None
    except (ControlError, OSError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        _sweep_interrupted(back())
    except termination.Terminated as e:
        # SIGTERM/SIGHUP (kill, `timeout`, a closed terminal) said where the levels went, but not what Ctrl-C says
        # of the GPU.
        click.echo(f"{_stopped_how(e)}: {back()}", err=True)
        raise
    except Exception as e:
        # Ctrl-C while DuckDB computes the levels' sensor figures comes back as a DuckDB error: a traceback.
        if not isinstance(termination.exit_inside(e), KeyboardInterrupt):
            raise
        _sweep_interrupted(back())


def _back_line(clocks: bool, changed: bool = True) -> str:
    if not changed:
        # Said after a sweep that stopped before its first level (no server, no GPU, an --out taken): "every GPU is
        # back at its original limit" there read as if one had been changed.
        return "no GPU setting was changed"
    return "every GPU is back at its original limit" + (", its clock lock released" if clocks else "")


def _sweep_interrupted(back: str):
    # Where the finished levels are kept was said as the sweep stopped (a run may stop before it has a directory).
    click.echo(f"interrupted: {back}", err=True)
    sys.exit(130)


def _trace_sweep(trace_path, time_scale, duration_s, limits, clocks, url, launch, simulate, gpus, api, interval_s,
                 launch_timeout, out_dir, idle_s, dry_run, repeats, order, allow_unmeasured_server_gpus=False) -> None:
    """`sweep --trace`: the whole trace at each level; J/token and latency per level, in a run directory."""
    import hashlib

    from powerprof.rig import Rig
    from powerprof.sweep import run_sweep

    from powerprof.workload.trace import TraceError, trace_bytes

    trace = _load_trace(trace_path, time_scale, duration_s)
    try:
        digest = hashlib.sha256(trace_bytes(Path(trace_path))).hexdigest()
    except TraceError as e:
        raise click.UsageError(str(e)) from None
    meta = {"path": str(Path(trace_path).resolve()), "sha256": digest, "time_scale": time_scale,
            "duration_s": duration_s, "span_s": trace[-1].t_s}
    unit = "W" if limits else "MHz"

    from powerprof import pipes

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    # The levels print while the sweep runs: a reader gone (`| head`) silences them, the sweep goes on.
    printed = [True]

    def echo(line):
        printed[0] = pipes.echo(line) and printed[0]

    def show(lv):
        echo(f"{lv.level_value:>6g}{unit:<2} {lv.n_ok:>5} {lv.n_failed:>6} {lv.generated_tokens:>7} "
             f"{f(lv.gpu_j_per_token, '9.3f')} {f(lv.tok_s, '9.1f')} {f(lv.request_tok_s, '9.1f')} {f(lv.ttft_p50_s, '8.3f')} "
             f"{f(lv.ttft_p95_s, '8.3f')} {f(lv.latency_p50_s, '7.2f')} {f(lv.latency_p95_s, '7.2f')}  {lv.energy_method}"
             + ("  others' work beside it (foreign-traffic, see the notes)" if lv.foreign_traffic else "")
             + ("  replayed once more: others' work beside the first (see the notes)"
                if lv.replayed_again and not lv.foreign_traffic else ""))

    if not dry_run:
        echo(f"trace {trace_path}: {len(trace)} requests over {trace[-1].t_s:.1f} s, each level replays all of it")
        echo("all tok/s: the replay's tokens over its span (the server's throughput, paced by the trace); req tok/s: "
             "the median request's own decode rate, the figure `analyze` compares levels by")
        echo(f"{'level':>8} {'ok':>5} {'failed':>6} {'tokens':>7} {'GPU J/tok':>9} {'all tok/s':>9} {'req tok/s':>9} {'TTFT p50':>8} "
             f"{'TTFT p95':>8} {'lat p50':>7} {'lat p95':>7}  method")
    from powerprof.sweep import UI

    class Notes(UI):
        # What the sweep says as it stops (where the finished levels are): without it a Ctrl-C said only
        # that the GPUs were back.
        def note(self, text):
            pipes.echo(text, err=True)

    with _sweep_exits(dry_run, clocks=bool(clocks)) as seen:
        with Rig(simulate, gpus=gpus) as rig:
            seen.rig = rig
            outcome = run_sweep(rig, levels_spec=limits or clocks, level_kind="power_limit" if limits else "sm_clock",
                                url=url, launch=launch, api=api, interval_s=interval_s, out_dir=out_dir,
                                launch_timeout_s=launch_timeout, command_line=" ".join(sys.argv), idle_s=idle_s,
                                dry_run=dry_run, repeats=repeats, order=order, trace=trace, trace_meta=meta,
                                on_level=show, ui=Notes(), allow_unmeasured_server_gpus=allow_unmeasured_server_gpus)
    back = None if dry_run else rig.restored_line(clocks=bool(clocks))
    for line in outcome.plan_lines if dry_run else [*(f"note: {n}" for n in outcome.notes), *([back] if back else []),
                                                    f"run directory: {outcome.run_dir}"]:
        echo(line)
    if dry_run and outcome.in_use:  # another run holds the GPU: the real one would fail as it starts
        sys.exit(1)
    if not dry_run and (outcome.levels is None or outcome.levels.num_rows == 0):
        raise click.ClickException("no level gave a J/token figure (the notes above say why)")
    if not printed[0]:
        sys.exit(pipes.EXIT_PIPE)


# --- daemon: always-on sampling, tagging proxy, Prometheus, tag API -----------------


@main.command("daemon")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config file.")
@simulate_option
@click.option("--sim-gpus", type=_IntRange(1, MAX_SIM_GPUS), default=None,
              help="Simulated GPU count (default: 1, or up to the highest index in daemon.gpus).")
@click.option("--listen", help="Proxy address HOST:PORT (proxy.listen).")
@click.option("--upstream", help="Inference server URL behind the proxy (proxy.upstream).")
@click.option("--metrics-listen", help="Prometheus /metrics address (metrics.listen).")
@click.option("--data-dir", help="Dataset folder (daemon.data_dir).")
@click.option("--interval", type=_Float(), help="Sampling period in seconds (daemon.interval_s).")
@click.option("--flush-interval", type=_Float(), help="Seconds between Parquet flushes (daemon.flush_interval_s).")
@click.option("--tag-socket", help="Tag API Unix socket (tags.socket).")
@click.option("--print-config", is_flag=True, help="Print the example config with every key and exit.")
@click.option("--check", is_flag=True, help="Validate the config and exit.")
def daemon_cmd(config_path, simulate, sim_gpus, listen, upstream, metrics_listen, data_dir, interval,
               flush_interval, tag_socket, print_config, check):
    """Always-on sampling, traffic-tagging proxy, crash-safe Parquet and Prometheus /metrics."""
    import sys

    from powerprof.daemon import config as dconfig
    from powerprof.daemon import service

    if print_config:
        click.echo(dconfig.example_toml())
        return
    flags = {
        "proxy.listen": "--listen", "proxy.upstream": "--upstream", "metrics.listen": "--metrics-listen",
        "daemon.data_dir": "--data-dir", "daemon.interval_s": "--interval", "daemon.flush_interval_s": "--flush-interval",
        "tags.socket": "--tag-socket",
    }
    given = {"--listen": listen, "--upstream": upstream, "--metrics-listen": metrics_listen, "--data-dir": data_dir,
             "--interval": interval, "--flush-interval": flush_interval, "--tag-socket": tag_socket}
    overrides = {key: given[flag] for key, flag in flags.items()}
    try:
        cfg = dconfig.load_config(config_path, overrides=overrides, flags=flags)
    except dconfig.ConfigError as e:
        click.echo(f"powerprof daemon: {e}", err=True)
        sys.exit(service.EXIT_CONFIG)
    try:
        from powerprof.rig import sim_gpu_count_of

        _check_sim_gpus(simulate, cfg.get("daemon", "gpus"), f"{cfg.source}: daemon.gpus", count=sim_gpus)
        # The simulated host's count as the start makes it (--sim-gpus, else daemon.gpus's indexes): [5] beside no
        # --sim-gpus passed --check, then the start refused it (a review's repro).
        _check_sim_gpus(simulate, cfg.get("daemon", "serving_gpus"), f"{cfg.source}: daemon.serving_gpus",
                        count=sim_gpu_count_of(simulate, cfg.get("daemon", "gpus"), sim_gpus) if simulate else None)
    except click.UsageError as e:
        click.echo(f"powerprof daemon: {e.message}", err=True)
        sys.exit(service.EXIT_CONFIG)
    if check:
        click.echo(f"config OK ({cfg.source})")
        # Every option given, --simulate's profile and --sim-gpus too: the note's command checks this very config.
        args = [a for flag, v in [("--config", config_path), ("--simulate", simulate), ("--sim-gpus", sim_gpus),
                                  *given.items()] if v is not None for a in (flag, str(v))]
        if (note := dconfig.check_user_note(args=args)) is not None:
            click.echo(note, err=True)
        return
    from powerprof.rig import Rig

    rig = Rig(simulate, gpus=cfg.get("daemon", "gpus") or None, sim_gpu_count=sim_gpus)
    sys.exit(service.main(cfg, rig, config_path=config_path, overrides=overrides))


@main.group("tag")
def tag_group() -> None:
    """Application-defined windows in the running daemon (its tag API)."""


def _tag_socket(socket, config_path):
    from powerprof.daemon import config as dconfig
    from powerprof.paths import cwd_gone

    for flag, path in (("--socket", socket), ("--config", config_path)):
        if path and (why := cwd_gone(path, flag)) is not None:  # said as "no daemon socket at", or no config file
            raise click.UsageError(why)
    if socket and len(os.fsencode(socket)) > dconfig.UNIX_PATH_MAX_BYTES:
        # The daemon's own check (tags.socket): no socket can be there. It was "cannot reach the daemon at …: OSError:
        # AF_UNIX path too long", exit 1, as if no daemon ran. The path as given, as connect() and the daemon's config
        # check take it: a short relative name in a deep folder reaches its socket (measured absolute, it was refused).
        raise click.UsageError(f"--socket {socket}: the path is {len(os.fsencode(socket))} bytes, more than "
                               f"the {dconfig.UNIX_PATH_MAX_BYTES} a unix socket's path may have, so no daemon's socket "
                               "can be there; give the daemon's tags.socket")
    if socket:
        return socket
    try:
        path = dconfig.load_config(config_path, data_dir_checked=False).tag_socket()
    except dconfig.ConfigError as e:
        raise click.ClickException(str(e))
    # A shell has no RUNTIME_DIRECTORY: the default was a folder of the caller's own, never the daemon's under the shipped
    # unit, and `powerprof tag start` said no daemon ran beside one that did.
    if config_path is None and not os.path.lexists(path) and os.path.lexists(dconfig.SYSTEMD_TAG_SOCKET):
        return dconfig.SYSTEMD_TAG_SOCKET
    return path


def _tag_call(action, name, socket, config_path):
    from powerprof.daemon.tagapi import TagApiError, send_tag

    try:
        return send_tag(_tag_socket(socket, config_path), action, name)
    except (TagApiError, ValueError) as e:
        raise click.ClickException(str(e))


_tag_opts = [
    click.option("--socket", help="The daemon's tag socket (default: from the config)."),
    click.option("--config", "config_path", type=click.Path(dir_okay=False), help="The daemon's TOML config."),
    click.option("--json", "as_json", is_flag=True, help=JSON_HELP),
]


def _with_tag_opts(f):
    for o in reversed(_tag_opts):
        f = o(f)
    return f


@tag_group.command("start")
@click.argument("name")
@_with_tag_opts
def tag_start(name, socket, config_path, as_json):
    """Open the window NAME now."""
    _tag_call("start", name, socket, config_path)
    if as_json:
        _echo_json({"name": name, "started": True})
        return
    click.echo(f"tag {name} started")


def _tag_figure(key: str, v):
    """A figure of the daemon's stop answer as --json prints it: seconds to the millisecond, joules and J/token to 6
    significant digits, and joules from 100 J on to the millijoule (the sum of readings printed
    `"duration_s": 0.30000000000000004`; a tiny energy rounded to the millijoule read 0.0, a 0 posing as a
    measurement); others as given."""
    if not isinstance(v, float) or v != v or v in (float("inf"), float("-inf")):
        return v
    if key == "duration_s" or (key.endswith("_energy_j") and abs(v) >= 100):
        return round(v, 3)
    if key == "gpu_j_per_token" or key.endswith("_energy_j"):
        return float(f"{v:.6g}")
    return v


@tag_group.command("stop")
@click.argument("name")
@_with_tag_opts
def tag_stop(name, socket, config_path, as_json):
    """Close the window NAME and print its energy."""
    r = _tag_call("stop", name, socket, config_path)
    if "unproxied_energy_j" not in r and r.get("gpu_j_per_token") is not None:  # a daemon from before the key
        older = ("the daemon is older than this command: its J/token is every GPU joule of the window over the "
                 "proxied tokens, bypass traffic's energy included (restart the daemon to take it out)")
        r = {**r, "note": f"{r['note']}; {older}" if r.get("note") else older}
    if as_json:
        _echo_json({"name": name, **{k: _tag_figure(k, r.get(k)) for k in (
            "duration_s", "gpu_energy_j", "cpu_energy_j", "unproxied_energy_j", "proxy_tokens", "gpu_j_per_token",
            "server_count", "energy_note", "note")}})
        return
    # A figure the daemon did not give (None) is printed as unknown, never as 0 (it read "GPU 0.0 J").
    def fig(key: str, fmt: str, unit: str) -> str:
        v = r.get(key)
        return f"{v:{fmt}} {unit}" if v is not None else f"unknown {unit}"

    jpt = r.get("gpu_j_per_token")
    # The row's energy_note (a daemon with the column) says why each empty or partial figure is so, with the fix: the
    # lines below that say the same for an older daemon's answer are not printed beside it.
    noted = r.get("energy_note")
    click.echo(
        f"tag {name}: {fig('duration_s', '.2f', 's')}, GPU {fig('gpu_energy_j', '.1f', 'J')} "
        f"(bypass traffic {fig('unproxied_energy_j', '.1f', 'J')}), {fig('proxy_tokens', '.0f', 'tokens')}"
        + (f", {jpt:.3f} J/token" if jpt is not None else
           "" if r.get("note") or noted else " (no J/token: no tokens were seen through the proxy)")
    )
    from powerprof.errtext import one_line  # noqa: PLC0415

    # The daemon's words reach a terminal: a socket given with --socket is whoever listens there (an escape
    # sequence in a fake daemon's energy_note acted on root's terminal).
    if r.get("note"):
        click.echo(f"note: {one_line(str(r['note']), 2000)}", err=True)
    if noted:
        click.echo(f"note: {one_line(str(noted), 2000)}", err=True)
    from powerprof.storage.schema import (SERVER_COUNT_COMPLETE, bypass_count_fix, bypass_count_low,  # noqa: PLC0415
                                          bypass_count_may_be)

    sc = r.get("server_count")
    if "server_count" not in r or (noted and bypass_count_low(sc)):  # an older daemon's answer (no such key), or the
        pass  # row's energy_note said it (bypass-uncounted)
    elif bypass_count_low(sc):  # the rule analyze's tag table leaves such a window out by
        click.echo(f"note: the server's token count over its intervals {bypass_count_may_be(sc)} or was not read "
                   f"(server_count "
                   f"{sc or 'unknown'}): bypass traffic beside it is not known, and its energy may be in this window's "
                   "J/token; `powerprof analyze` leaves this window out of its tag's figures; fix: "
                   f"{bypass_count_fix(sc)} (docs/daemon.md, Which rows may be low)", err=True)
    elif sc != SERVER_COUNT_COMPLETE:  # off, slots_only: kept, as analyze keeps them, and said as it says them
        click.echo(f"note: bypass traffic was not measured over this window, or in part (server_count {sc}): any "
                   "requests sent straight to the server put their energy in this window's J/token, which then reads "
                   f"high; fix: {bypass_count_fix(sc)} (docs/daemon.md, Bypass traffic)", err=True)


@tag_group.command("list")
@_with_tag_opts
def tag_list(socket, config_path, as_json):
    """List open windows."""
    names = _tag_call("list", None, socket, config_path).get("open", [])
    if as_json:
        _echo_json({"open": names})
        return
    from powerprof.errtext import one_line  # noqa: PLC0415

    for n in names:
        click.echo(one_line(str(n), 200))
    if not names:  # on stderr: a script reading the names gets none
        click.echo("no tag window is open", err=True)


def _json_text(obj, **kw) -> str:
    """JSON every parser reads: a NaN or an infinity (a figure that could not be computed) is null, never the bare
    `NaN` Python writes by default (measure --json gave `"prompt_offset": NaN`: jq and strict parsers refuse it)."""
    import json
    import math

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    ctx = click.get_current_context(silent=True)
    if ctx is not None:  # printed next: an error after it is not said as a second object (_json_error)
        ctx.meta[JSON_SAID] = True
    return json.dumps(clean(obj), allow_nan=False, **kw)


def _echo_json(obj) -> None:
    click.echo(_json_text(obj, indent=2))


if __name__ == "__main__":
    main()
