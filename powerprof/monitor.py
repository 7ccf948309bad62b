"""Live monitor: runs the sampler over open sources, turns each completed tick into display rows, and runs `monitor`.

Three views of the same rows: `render` (a rich panel per GPU, nvitop-style: name, memory used/total,
bars, load and temperature coloured), `lines` (plain text for pipes and logs) and `json_line`
(one JSON object per tick for scripts). Bars are drawn with █/░, so they read without colour too.
`watch` is the command's run on the sources the door opened (its --output spooled as it comes), `check_output` and
`recover_output` its --output and --recover; they raise OptionRefused, MonitorUsageError or MonitorError for the
command to word, and print through the callables it passes (this module knows no click).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

import json

from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from powerprof.collectors.nvml import clock_event_reason_names
from powerprof.collectors.sampler import Sample, Sampler
from powerprof.collectors.sources import Sources
from powerprof.storage.samples import Timeline
from powerprof.terminal_plot import Together

TickFn = Callable[[int, dict], None]


def interval_notes(sources: Sources, interval_s: float) -> list[str]:
    """What this interval cannot show, said once at the start rather than as a column of '-'."""
    from powerprof.collectors.rapl import MIN_POWER_INTERVAL_S  # noqa: PLC0415

    if sources.rapl is not None and interval_s < MIN_POWER_INTERVAL_S:
        return [f"CPU power needs at least {MIN_POWER_INTERVAL_S:g} s between RAPL reads (its counters step too "
                f"coarsely for less): at --interval {interval_s:g} it shows as '-' and is empty in --output; the "
                f"energy (J) is still counted. Use --interval {MIN_POWER_INTERVAL_S:g} or more to see it."]
    return []


class _TickWatcher:
    """Subscriber that lets the main thread wait until every source has delivered tick k."""

    def __init__(self, sources: list[str]):
        self._cond = threading.Condition()
        self._seen = {s: -1 for s in sources}

    def __call__(self, s: Sample) -> None:
        if s.seq >= 0:
            with self._cond:
                if s.seq > self._seen.get(s.source, -1):
                    self._seen[s.source] = s.seq
                    self._cond.notify_all()

    def wait_tick(self, k: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: min(self._seen.values()) >= k, max(0.0, timeout_s))


def run_monitor(
    sources: Sources,
    interval_s: float = 1.0,
    duration_s: float | None = None,
    on_tick: TickFn | None = None,
    stop: threading.Event | None = None,
    timeline: Timeline | None = None,
    keep: bool = True,
) -> Timeline:
    """Sample until `duration_s` has been covered (ticks 0..floor(duration/interval)) or `stop` is set.

    on_tick(k, display) is called in this thread once tick k is complete for every source, or
    when the next tick is due (a slow source then shows its previous value). Every sample goes to
    `timeline` (pass your own to keep what was taken when interrupted), which is returned.
    keep=False: no sample goes to it (a monitor with nothing to write would hold every one for its whole run).
    """
    collectors = sources.collectors
    if not collectors:
        raise RuntimeError("nothing to monitor: no GPU, RAPL or host collector could be opened")
    timeline = timeline if timeline is not None else Timeline(gpu_uuids=sources.gpu_uuids)
    sampler = Sampler(collectors, interval_s=interval_s)
    watcher = _TickWatcher([c.source for c in collectors])
    last = None if duration_s is None else int(duration_s / interval_s + 1e-6)

    def through_last(s: Sample) -> None:
        # A loaded machine can take tick last+1 before the sampler stops: --duration keeps ticks 0..last.
        if s.seq <= last:
            timeline(s)

    if keep:
        sampler.subscribe(timeline if last is None else through_last)
    sampler.subscribe(watcher)
    stop = stop or threading.Event()
    baseline: dict[str, float] = {}
    infos = {i.index: i for i in sources.nvml.infos} if sources.nvml is not None else {}
    sampler.start()
    try:
        k = 0
        while not stop.is_set():
            next_due_s = (sampler.t0_ns + (k + 1) * sampler.interval_ns - time.monotonic_ns()) / 1e9
            if last is not None and k >= last:
                # No later tick will show it: give the last one a grace period before the sampler stops,
                # or a loaded machine's --duration output loses its final sample.
                next_due_s += max(interval_s, 1.0)
            watcher.wait_tick(k, next_due_s)
            if on_tick is not None:
                on_tick(k, display_rows(sampler.latest, baseline, infos))
            if last is not None and k >= last:
                break
            k += 1
    finally:
        sampler.stop()
    return timeline


def _fmt(v, nd=0, unit=""):
    if v is None:
        return "-"
    return f"{v:.{nd}f}{unit}"


def display_rows(latest: dict[str, Sample], baseline: dict[str, float], infos: dict | None = None) -> dict:
    """What one tick shows: GPU rows, CPU (RAPL) rows, a host line. Energies count from the first
    tick shown (`baseline` remembers each device's first value); `infos` (NVML index → GpuInfo)
    adds each GPU's name and memory size."""
    infos = infos or {}
    gpus, cpus, host = [], [], None
    s = latest.get("nvml")
    if s is not None and s.data is not None:
        for r in s.data:
            key = f"gpu{r.index}"
            if r.energy_j is not None:
                baseline.setdefault(key, r.energy_j)
            info = infos.get(r.index)
            gpus.append(
                {
                    "device": key,
                    "name": info.name if info is not None else None,
                    "mem_used_bytes": r.mem_used_bytes,
                    "mem_total_bytes": info.memory_total_bytes if info is not None else None,
                    "power_w": r.power_w,
                    "power_avg_w": r.power_avg_w,
                    "energy_j": r.energy_j - baseline[key] if r.energy_j is not None else None,
                    "sm_clock_mhz": r.sm_clock_mhz,
                    "mem_clock_mhz": r.mem_clock_mhz,
                    "gpu_util_pct": r.gpu_util_pct,
                    "mem_util_pct": r.mem_util_pct,
                    "temperature_c": r.temperature_c,
                    "enforced_limit_w": r.enforced_limit_w,
                    "reasons": clock_event_reason_names(r.clock_event_reasons),
                    "note": r.note,
                }
            )
    elif s is not None:
        gpus.append({"device": "nvml", "error": s.error})
    s = latest.get("rapl")
    if s is not None and s.data is not None:
        for r in s.data:
            if r.energy_j is not None:
                baseline.setdefault(r.zone, r.energy_j)
                baseline.setdefault(r.zone + "#epoch", r.epoch)
            e = r.energy_j - baseline[r.zone] if r.energy_j is not None else None
            # A dropped delta (a wrap missed, a jump, a stalled counter) is energy never counted: the sum
            # since start is then a lower bound, and says so.
            missed = r.epoch != baseline.get(r.zone + "#epoch", r.epoch)
            cpus.append({"device": r.zone, "kind": r.kind, "power_w": r.power_w, "energy_j": e,
                         "energy_lower_bound": missed, "note": r.note})
    elif s is not None:
        cpus = [{"device": "rapl", "error": s.error}]
    s = latest.get("host")
    if s is not None and s.data is not None:
        host = {"cpu_util_pct": s.data.cpu_util_pct, "cpu_freq_mhz": s.data.cpu_freq_mhz}
    return {"gpus": gpus, "cpus": cpus, "host": host}


LOAD_LEVELS = ((50.0, "green"), (80.0, "yellow"), (float("inf"), "red"))  # % of capacity → colour
TEMP_LEVELS_C = ((60.0, "green"), (80.0, "yellow"), (float("inf"), "red"))
BAR_W = 18
MAX_PANELS = 4


def level_style(value: float | None, levels) -> str:
    """The colour of a value: the first threshold it stays below."""
    if value is None:
        return "dim"
    return next(style for limit, style in levels if value < limit)


def bar(pct: float | None, width: int = BAR_W) -> Text:
    """█ for the used share, ░ for the rest, coloured by load; an unknown value is an empty dim bar."""
    if pct is None:
        return Text("░" * width, style="dim")
    n = round(max(0.0, min(100.0, pct)) / 100 * width)
    return Text.assemble(("█" * n, level_style(pct, LOAD_LEVELS)), ("░" * (width - n), "dim"))


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.1f}"


def _pct(a, b) -> float | None:
    return 100.0 * a / b if a is not None and b else None


def gpu_panel(g: dict) -> Panel | Text:
    """One GPU as nvitop shows it: name and temperature on top, then load, memory and power bars."""
    if "error" in g:
        return Text(f"{g['device']}: {g['error']}", style="red")
    temp = g["temperature_c"]
    head = Text.assemble((f"{g['device']} ", "bold"), (g.get("name") or "", "bold cyan"))
    t = Table.grid(padding=(0, 1))
    for _ in range(4):
        t.add_column(no_wrap=True)
    mem_pct = _pct(g.get("mem_used_bytes"), g.get("mem_total_bytes"))
    pwr = g["power_w"] if g["power_w"] is not None else g["power_avg_w"]
    pwr_pct = _pct(pwr, g["enforced_limit_w"])
    t.add_row(Text("UTIL", style="bold"), bar(g["gpu_util_pct"]),
              Text(_fmt(g["gpu_util_pct"], 0, "%").rjust(4), style=level_style(g["gpu_util_pct"], LOAD_LEVELS)),
              Text.assemble("temp ", (_fmt(temp, 0, "°C"), level_style(temp, TEMP_LEVELS_C))))
    t.add_row(Text("MEM", style="bold"), bar(mem_pct),
              Text(_fmt(mem_pct, 0, "%").rjust(4), style=level_style(mem_pct, LOAD_LEVELS)),
              f"{_gib(g.get('mem_used_bytes'))} / {_gib(g.get('mem_total_bytes'))} GiB")
    t.add_row(Text("PWR", style="bold"), bar(pwr_pct),
              Text(_fmt(pwr_pct, 0, "%").rjust(4), style=level_style(pwr_pct, LOAD_LEVELS)),
              f"{_fmt(pwr, 1)} / {_fmt(g['enforced_limit_w'], 0)} W  avg {_fmt(g['power_avg_w'], 1)} W")
    # Wrapped between figures only: at 50 columns "SM 1980" ended a line and "MHz" began the next.
    foot = Together([f"SM {_fmt(g['sm_clock_mhz'], 0, ' MHz')}", f"mem {_fmt(g['mem_clock_mhz'], 0, ' MHz')}",
                     f"energy {_fmt(g['energy_j'], 1, ' J')}", f"reasons {_reasons(g['reasons'])}"], sep="  ", style="dim")
    parts = [t, foot] + ([Text(g["note"], style="yellow")] if g.get("note") else [])
    return Panel(Group(*parts), title=head, title_align="left", box=box.ROUNDED, padding=(0, 1), expand=False)


def render(k: int, rows: dict, interval_s: float) -> Group:
    """A rich renderable for a terminal: a panel per GPU, then the CPU line (the compact table
    beyond MAX_PANELS GPUs, where panels would not fit a screen)."""
    if len(rows["gpus"]) > MAX_PANELS:
        return render_table(k, rows, interval_s)
    parts: list = [Text(f"powerprof monitor  t={k * interval_s:.1f} s  (every {interval_s:g} s, Ctrl-C to stop)",
                        style="bold")]
    parts += [gpu_panel(g) for g in rows["gpus"]]
    cpu = _cpu_parts(rows)
    if cpu:
        parts.append(Together(cpu, sep=" | ", head="CPU: "))
    return Group(*parts)


def json_line(k: int, rows: dict, interval_s: float) -> str:
    """`monitor --json`: one object per tick with stable keys (t_s, gpus, cpus, host)."""
    return json.dumps({"t_s": round(k * interval_s, 6), **rows}, separators=(",", ":"))


def render_table(k: int, rows: dict, interval_s: float) -> Group:
    """The compact table (one row per GPU), for many GPUs at once."""
    t = Table(title=f"powerprof monitor  t={k * interval_s:.1f}s", title_justify="left", box=box.SIMPLE_HEAD,
              padding=(0, 1), collapse_padding=True, pad_edge=False)
    # Two-line headers and no vertical rules: the table fits an 80-column terminal without eliding numbers.
    for col in ("GPU", "power\nW", "avg\nW", "energy\nJ", "SM\nMHz", "mem\nMHz", "util\n%", "mem\n%", "temp\n°C",
                "limit\nW", "clock event\nreasons"):
        last = col.startswith("clock")
        t.add_column(col, justify="left" if last or col == "GPU" else "right", no_wrap=not last)
    for g in rows["gpus"]:
        if "error" in g:
            t.add_row(g["device"], Text(str(g["error"]), style="red"))
            continue
        t.add_row(
            g["device"], _fmt(g["power_w"], 1), _fmt(g["power_avg_w"], 1), _fmt(g["energy_j"], 1),
            _fmt(g["sm_clock_mhz"]), _fmt(g["mem_clock_mhz"]), _fmt(g["gpu_util_pct"]), _fmt(g["mem_util_pct"]),
            _fmt(g["temperature_c"]), _fmt(g["enforced_limit_w"]),
            _reasons(g["reasons"]),
        )
    parts = [t]
    # Below the table: a long note in a cell would squeeze every column to nothing.
    parts += [Text(f"{g['device']}: {g['note']}", style="yellow") for g in rows["gpus"] if g.get("note")]
    cpu = _cpu_parts(rows)
    if cpu:
        parts.append(Together(cpu, sep=" | ", head="CPU: "))
    return Group(*parts)


def _reasons(names: list[str] | None) -> str:
    if names is None:
        return "-"  # not supported
    return ",".join(names) if names else "none"


def _cpu_line(rows: dict) -> str:
    bits = _cpu_parts(rows)
    return "CPU: " + " | ".join(bits) if bits else ""


def _cpu_parts(rows: dict) -> list[str]:
    """The CPU line's parts: each package's power and energy, the host's utilisation and clock."""
    bits = []
    for c in rows["cpus"]:
        if "error" in c:
            bits.append(f"{c['device']}: {c['error']}")
        else:
            e = ("≥" if c.get("energy_lower_bound") and c["energy_j"] is not None else "") + _fmt(c["energy_j"], 1, " J")
            bits.append(f"{c['device']} {_fmt(c['power_w'], 1, ' W')} ({e})" + (f" note: {c['note']}" if c.get("note") else ""))
    h = rows["host"]
    if h:
        bits.append(f"CPU util {_fmt(h['cpu_util_pct'], 0, '%')} @ {_fmt(h['cpu_freq_mhz'], 0, ' MHz')}")
    return bits


def lines(k: int, rows: dict, interval_s: float) -> list[str]:
    """Plain text for pipes and logs: one line per GPU plus one CPU line."""
    ts = f"t={k * interval_s:7.1f}s"
    out = []
    for g in rows["gpus"]:
        if "error" in g:
            out.append(f"{ts} {g['device']} error: {g['error']}")
            continue
        out.append(
            f"{ts} {g['device']} power={_fmt(g['power_w'], 1)}W avg={_fmt(g['power_avg_w'], 1)}W "
            f"energy={_fmt(g['energy_j'], 1)}J sm={_fmt(g['sm_clock_mhz'])}MHz mem={_fmt(g['mem_clock_mhz'])}MHz "
            f"util={_fmt(g['gpu_util_pct'])}/{_fmt(g['mem_util_pct'])}% temp={_fmt(g['temperature_c'])}C "
            f"limit={_fmt(g['enforced_limit_w'])}W reasons={_reasons(g['reasons'])}"
            + (f" note: {g['note']}" if g.get("note") else "")
        )
    cpu = _cpu_line(rows)
    if cpu:
        out.append(f"{ts} {cpu}")
    return out


# --- the command: `powerprof monitor` on the sources the door opened ---------------------------------------------


class OptionRefused(Exception):
    """An option's value monitor will not take (a usage error naming the option)."""

    def __init__(self, message: str, option: str):
        super().__init__(message)
        self.option = option


class MonitorUsageError(Exception):
    """What monitor was asked cannot be done (a usage error: an interval the RAPL counters cannot span)."""


class MonitorError(Exception):
    """Monitor cannot run or finish (exit 1): nothing to monitor, a recovery that cannot be written."""


def check_output(output: str, force: bool) -> None:
    """`--output FILE` refused before anything opens (OptionRefused): a file of an earlier run without --force, a
    FIFO or a device, a folder root may not write in, or the parts a killed monitor of that name left."""
    from powerprof.paths import cwd_joined, output_file_refusal
    from powerprof.storage.samples import SPOOL_DEPTH_BYTES, check_output_path, parts_dir_for
    from powerprof.trust import out_dir_refusal

    from powerprof.storage.runs import missing_parent

    # A relative FILE from a removed current folder (said as "folder '.' is not writable"), or a missing folder: in
    # every command's words (storage.runs.missing_parent, exit 2). Its parts' files beside it are its deepest write.
    if (why := missing_parent(output, "--output", SPOOL_DEPTH_BYTES)) is not None:
        raise MonitorUsageError(why)
    # The write at the end replaced an earlier run's samples without a word; --force, a FIFO or a device.
    if (why := output_file_refusal(output, force, "samples of an earlier run?")) is not None:
        raise OptionRefused(why, "--output")
    try:
        check_output_path(output)
    except ValueError as e:
        raise OptionRefused(str(e), "--output") from None
    why = out_dir_refusal(cwd_joined(output).parent, "folder", "--output FILE")
    if why:  # as root (sudo for RAPL): FILE.parts/, its parts and FILE are made there by names known in advance
        raise OptionRefused(why, "--output")
    parts = parts_dir_for(output)
    if os.path.lexists(parts):
        # A monitor of this name that could not finish (kill -9, OOM, power cut) left its samples there;
        # --force replaces the file, never them.
        raise OptionRefused(f"{parts} exists: the samples of a monitor --output {output} that was killed "
                            "before it could combine them (kill -9, out of memory, power cut), readable as "
                            f"a Parquet folder; combine them into {output} first with `powerprof monitor "
                            f"--recover {output}`, or move the folder away", "--output")


def watch(rig, interval_s: float, duration_s: float | None, output: str | None, force: bool, plain: bool,
          as_json: bool, echo: Callable[..., None], warn: Callable[[str], None]) -> BaseException | None:
    """Show the rig's sources every `interval_s` until `duration_s` or a stop, writing every sample to `output` as
    it comes. `echo(text, err=False)` prints a line; `warn` says a problem on stderr. Returns the exit to raise once
    the rig is closed (a signal's Terminated, a closed stdout's exit 141), None for a normal end or Ctrl-C."""
    from rich.console import Console
    from rich.live import Live

    from powerprof import pipes, termination
    from powerprof.storage.samples import SampleSpool, parts_dir_for

    console = Console()
    src = rig.sources
    timeline = Timeline(gpu_uuids=src.gpu_uuids)
    for p in src.problems:
        warn(f"problem ({p.source}): {p.message}")
    if not src.collectors:
        raise MonitorError("nothing to monitor")
    for note in interval_notes(src, interval_s):
        echo(f"note: {note}", err=True)

    stopped = None
    pipe_closed = False
    spool = None
    if output is not None:
        meta = {"powerprof_command": "monitor", "simulated": str(rig.simulated).lower(),
                "gpus": json.dumps([{"index": i.index, "uuid": i.uuid, "name": i.name}
                                    for i in (src.nvml.infos if src.nvml else [])])}
        try:
            # Written as they come (FILE.parts/), so a kill -9 keeps all but the last seconds.
            spool = SampleSpool(timeline, output, meta).start()
        except FileExistsError:
            raise OptionRefused(f"{parts_dir_for(output)} appeared meanwhile (another monitor of that name)",
                                "--output") from None
    try:
        # SIGTERM/SIGHUP (kill, timeout, a closed terminal) keep the samples as Ctrl-C does
        with termination.signals_raise():
            if as_json:
                run_monitor(src, interval_s, duration_s, timeline=timeline, keep=output is not None,
                            on_tick=lambda k, rows: echo(json_line(k, rows, interval_s)))
            elif console.is_terminal and not plain:
                with Live(console=console, auto_refresh=False) as live:
                    run_monitor(
                        src, interval_s, duration_s, timeline=timeline, keep=output is not None,
                        on_tick=lambda k, rows: live.update(render(k, rows, interval_s), refresh=True),
                    )
            else:
                run_monitor(
                    src, interval_s, duration_s, timeline=timeline, keep=output is not None,
                    on_tick=lambda k, rows: [echo(line) for line in lines(k, rows, interval_s)],
                )
    except ValueError as e:  # e.g. an interval too long for the RAPL counters' wrap period
        if spool is not None and spool.abandon():
            pipes.echo_err(f"the samples taken so far are in {spool.parts_dir} (a Parquet folder)")
        raise MonitorUsageError(str(e)) from None
    except KeyboardInterrupt:
        pipes.echo_err("interrupted")  # still write what was sampled (a `2>&1 | head` is gone too)
    except termination.Terminated as e:
        stopped = e
        pipes.echo_err(termination.stopped_how(e))  # still write what was sampled, then exit 128 + signum
    except BrokenPipeError:
        if not pipes.silence_closed():
            raise
        pipe_closed = True  # the reader has gone (`| head -3`): stop, still write what was sampled
    except BaseException:
        if spool is not None and spool.abandon():
            pipes.echo_err(f"the samples taken so far are in {spool.parts_dir} (a Parquet folder)")
        raise
    if spool is not None:
        # Checked at the start only: a file made there since (another monitor of that name) is kept.
        with termination.exits_held() as late:  # a Ctrl-C while the parts are combined waits for the file
            path, rows = spool.close(replace=force)
        if late and stopped is None and isinstance(termination.exit_for(late[0]), termination.Terminated):
            stopped = termination.exit_for(late[0])  # SIGTERM/SIGHUP: 128 + signal; a Ctrl-C ends as one does, exit 0
        if Path(path) != Path(output):
            pipes.echo_err(f"{output} appeared while monitor ran and is kept; the samples went beside it")
        # Rows, as the file holds them: one read of RAPL gives a row per zone.
        pipes.echo_err(f"wrote {rows} rows ({spool.reads} reads) to {path}")
        if spool.left:  # put there while it ran, by someone else: kept
            pipes.echo_err(f"left: {spool.left} other file{'s' if spool.left != 1 else ''} in {spool.parts_dir}, "
                           "not written by monitor")
    if stopped is not None:
        return stopped
    if pipe_closed:
        return SystemExit(pipes.EXIT_PIPE)
    return None


def recover_output(output: str, force: bool) -> None:
    """`monitor --recover FILE`: the parts of a killed `monitor --output FILE` as FILE, then the parts removed.
    Raises OptionRefused for a FILE or folder it will not write, MonitorError for a recovery that failed."""
    from powerprof import pipes
    from powerprof.paths import TEMP_NAME_BYTES, cwd_joined, output_file_refusal
    from powerprof.storage.samples import RecoverError, check_output_path, parts_dir_for, recover_parts
    from powerprof.trust import out_dir_refusal

    from powerprof.storage.runs import missing_parent

    if (why := missing_parent(output, "--recover", TEMP_NAME_BYTES)) is not None:  # as --output's; FILE alone written
        raise MonitorUsageError(why)
    # A FIFO, a device or a symlink at FILE is refused even with --force (the rename would replace it by a file).
    if (why := output_file_refusal(output, True, "")) is not None:
        raise OptionRefused(why, "--recover")
    try:
        check_output_path(output)
    except ValueError as e:
        raise OptionRefused(str(e), "--recover") from None
    parts = parts_dir_for(output)
    # FILE's folder as --output checks it (a folder root writes FILE in: not root's sticky /tmp), then the parts.
    why = (out_dir_refusal(cwd_joined(output).parent, "folder", "--recover FILE")
           or out_dir_refusal(parts, "the parts folder", "--recover FILE"))
    if why:  # as root: the lock, FILE and the parts' removal are names another user could point elsewhere
        raise OptionRefused(why, "--recover")
    if not parts.is_dir():
        raise OptionRefused(f"{parts} does not exist: nothing to recover (a killed monitor --output {output} "
                            "leaves its samples there)", "--recover")
    if os.path.lexists(output) and not force:
        raise OptionRefused(f"{output} exists (samples of an earlier run?); choose another name for the "
                            f"recovered samples (move {parts} beside it), or --force to replace it", "--recover")
    try:
        path, rows, left = recover_parts(output, replace=force)
    except FileExistsError:  # made while the parts were combined
        raise MonitorError(f"{output} appeared while the parts were combined and is kept; so are the parts "
                           f"({parts})") from None
    except RecoverError as e:
        raise MonitorError(str(e)) from None
    except OSError as e:
        raise MonitorError(f"cannot write {output}: {e.strerror or e}; the parts are kept ({parts})") from None
    if left:  # a file in the folder that no monitor wrote (the user's notes): kept, and the folder with it
        pipes.echo_err(f"wrote {rows} rows to {path} (recovered from {parts}: its parts removed; left: {left} other "
                       f"file{'s' if left != 1 else ''} in {parts}, not written by monitor)")
    else:
        pipes.echo_err(f"wrote {rows} rows to {path} (recovered from {parts}, now removed)")
