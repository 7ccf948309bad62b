"""Configuration sweeps: launch the server once per combination of its knobs, measure it at each context length and level.

    sweep --launch "llama-server ... --spec-draft-n-max {draft} -np {np}" --server URL \\
          --vary draft=1,2,3,4,5 --vary np=1,2,4 [--context-tokens 512,8k] [--limits 220,300]

For each configuration (the cross product of the --vary values, in the order given): render the
template, launch, wait for health, then for each context length run a `Sweep` over the levels
(launch once, step the levels), stop the server. A configuration that fails to start (out of
memory, a bad flag, no health) is recorded with its log tail and the grid goes on; so is one
whose measurement fails. The template is split into words like a shell line before the values go in (no shell runs it), so
a value with spaces, quotes or `;` stays one argument. One run directory holds the grid: every windows and levels row carries
`config_id`, `context_tokens` and a `knob_<name>` column per knob.
"""

from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

OOM_PATTERN = re.compile(r"out of memory|cudaMalloc failed|\bOOM\b|CUDA_ERROR_OUT_OF_MEMORY|OutOfMemoryError", re.I)
_FIELD = re.compile(r"\{([A-Za-z_]\w*)\}")


@dataclass(frozen=True)
class Knob:
    name: str
    values: tuple  # int, float or str each, as typed on the command line


def _typed(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_vary(specs) -> list[Knob]:
    """["draft=1,2,3", "np=1,2,4"] → knobs. ValueError with a one-line reason on bad input."""
    knobs: list[Knob] = []
    for spec in specs:
        name, sep, vals = spec.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise ValueError(f"--vary {spec!r}: write NAME=V1,V2,... with NAME a word (an ASCII letter or _ first, then "
                             "letters, digits or _)")
        items = [v.strip() for v in vals.split(",")]
        if not any(items):
            raise ValueError(f"--vary {spec!r}: no values")
        if "" in items:
            raise ValueError(f"--vary {spec!r}: empty item in the value list (a typo?)")
        values = tuple(_typed(v) for v in items)
        if len(set(values)) != len(values):
            raise ValueError(f"--vary {spec!r}: a value repeats")
        if any(k.name == name for k in knobs):
            raise ValueError(f"--vary {name} given twice")
        knobs.append(Knob(name, values))
    return knobs


def template_fields(template: str) -> set[str]:
    """The {name} placeholders of a launch template (JSON braces such as {"method": ...} are not placeholders)."""
    return set(_FIELD.findall(template))


def split_template(template: str) -> list[str]:
    try:
        return shlex.split(template)
    except ValueError as e:
        raise ValueError(f"--launch {template!r}: {e}: quotes must pair (it is split into words like a shell "
                         "line; no shell runs it)") from None


def check_template(template: str, knobs: list[Knob]) -> None:
    split_template(template)
    names = {k.name for k in knobs}
    unknown = template_fields(template) - names
    if unknown:
        raise ValueError(f"--launch names {', '.join('{' + u + '}' for u in sorted(unknown))}, which no --vary gives")
    unused = names - template_fields(template)
    if unused:
        raise ValueError(f"--vary {', '.join(sorted(unused))}: the --launch template has no "
                         + ", ".join("{" + u + "}" for u in sorted(unused)))


def render(template: str, config: dict) -> str:
    return _FIELD.sub(lambda m: str(config[m.group(1)]) if m.group(1) in config else m.group(0), template)


def command(template: str, config: dict) -> list[str]:
    """One configuration's argv: the template's words, each rendered, so a value is never split or parsed.
    (Inside an `sh -c '...'` word a value is still shell code: the shell, not powerprof, reads that word.)"""
    return [render(word, config) for word in split_template(template)]


def configurations(knobs: list[Knob]) -> list[dict]:
    """Every combination, the first knob varying slowest."""
    return [dict(zip([k.name for k in knobs], combo)) for combo in itertools.product(*[k.values for k in knobs])] or [{}]


def config_id(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items()) or "as-launched"


def launch_status(message: str) -> str:
    """out-of-memory when the server's words say so, else failed-to-start."""
    return "out-of-memory" if OOM_PATTERN.search(message) else "failed-to-start"


@dataclass(frozen=True)
class GridSpec:
    """What varies: the knobs of the launch template and the context lengths (tokens; empty: the prompt set)."""

    template: str | None
    knobs: tuple[Knob, ...] = ()
    contexts: tuple[int, ...] = ()

    def __post_init__(self):
        if self.knobs and not self.template:
            raise ValueError("--vary needs --launch: a template whose {name} placeholders take the values")
        if self.template and self.knobs:
            check_template(self.template, list(self.knobs))

    @property
    def configs(self) -> list[dict]:
        return configurations(list(self.knobs))

    def plan_lines(self) -> list[str]:
        out = [f"{len(self.configs)} configuration(s) × {max(len(self.contexts), 1)} context length(s):"]
        for c in self.configs:
            out.append(f"  {config_id(c)}: " + (shlex.join(command(self.template, c)) if self.template else "(the given server)"))
        if self.contexts:
            out.append("  context tokens: " + ", ".join(str(n) for n in self.contexts))
        return out


@dataclass
class ConfigRecord:
    """What happened to one configuration (and context length)."""

    config: dict
    context_tokens: int | None
    status: str  # ok | out-of-memory | failed-to-start | failed
    error: str | None = None
    command: str | None = None
    log_path: str | None = None
    prompt_tokens: int | None = None
    counted_by: str | None = None
    spec_metrics: tuple[float, float] | None = None  # vLLM counters' difference over the configuration

    @property
    def config_id(self) -> str:
        return config_id(self.config)

    def columns(self) -> dict:
        from powerprof.storage.schema import KNOB_PREFIX

        return {"config_id": self.config_id, "context_tokens": self.context_tokens,
                **{KNOB_PREFIX + k: v for k, v in self.config.items()}}

    def to_dict(self) -> dict:
        return {"config_id": self.config_id, "config": self.config, "context_tokens": self.context_tokens,
                "status": self.status, "error": self.error, "command": self.command, "log": self.log_path,
                "prompt_tokens": self.prompt_tokens, "counted_by": self.counted_by}


class _GridWriter:
    """Handed to each Sweep as its writer: its per-level flushes rewrite the whole grid's tables."""

    def __init__(self, grid: "GridRun", sweep_ref: list):
        self.grid = grid
        self.sweep_ref = sweep_ref

    def write(self, name, table, coming=None) -> None:
        pass  # the grid writes every table once per flush, from all sweeps

    def write_json(self, **extra) -> None:
        self.grid.flush(current=self.sweep_ref[0] if self.sweep_ref else None)


@dataclass
class GridRun:
    """Runs the grid on an open rig, profiler, controller and timeline (see sweep.run_sweep)."""

    spec: GridSpec
    settings: object  # SweepSettings
    rig: object
    url: str
    api: str | None
    prompts: list
    params: object
    profiler: object
    controller: object | None
    timeline: object
    writer: object  # RunWriter
    run_id: str
    reference_value: float | None
    ui: object | None
    launch_timeout_s: float = 300.0
    records: list[ConfigRecord] = field(default_factory=list)
    done: list = field(default_factory=list)  # (ConfigRecord, Sweep) measured
    idle_power_w: float | None = None
    _finished_levels: dict = field(default_factory=dict)  # id(Sweep) → its levels rows (bootstraps are not free)
    # Each GPU's power limits as the grid's first level began: configurations measured at the settings as they are
    # (or at locked clocks) are compared, so every one of them must run at those (Sweep._limit_problem).
    _held_limits: dict = field(default_factory=dict)
    # A server GPU not measured, said instead of refused (sweep --allow-unmeasured-server-gpus); what the placement
    # check of each configuration's server said (workload/placement.py), for run.json's notes.
    allow_unmeasured_server_gpus: bool = False
    placement_notes: list = field(default_factory=list)

    def excluded(self):
        """Measured windows of every configuration that the figures left out (untrusted timing); None if none."""
        from powerprof.workload.measure import excluded_windows

        kind = "request" if self.settings.concurrency == 1 else "batch"
        return excluded_windows([r for _, sw in self.done for r in sw.rows], counted_kind=lambda r: kind)

    def run(self) -> None:
        configs = self.spec.configs
        # The plan, before any is measured: a grid killed (kill -9) before a configuration left no word of it
        # (run.json `configs` lists those begun), so `analyze` could not say it was never measured.
        self.writer.write_json(configs_planned=[[config_id(c), n] for c in configs for n in self.spec.contexts or [None]])
        for i, cfg in enumerate(configs):
            self._note(f"configuration {i + 1}/{len(configs)}: {config_id(cfg)}")
            self._run_config(cfg)
            self.flush()

    def _note(self, text: str) -> None:
        if self.ui is not None:
            self.ui.note(text)

    def _run_config(self, cfg: dict) -> None:
        import contextlib

        from powerprof.workload.launcher import LaunchError, tail

        argv = command(self.spec.template, cfg) if self.spec.template else None
        cmd = shlex.join(argv) if argv else None
        log = None
        if cmd:
            logs = Path(self.writer.path) / "server-logs"
            logs.mkdir(exist_ok=True)
            log = logs / (re.sub(r"[^\w=.,-]", "_", config_id(cfg)) + ".log")
        contexts = list(self.spec.contexts) or [None]
        try:
            launched: list = []
            server_cm = self.rig.server(self.url, argv, launch_timeout_s=self.launch_timeout_s, log_path=log,
                                        launched=launched)
            url = server_cm.__enter__()
        except LaunchError as e:
            status = launch_status(str(e))
            self._note(f"  {config_id(cfg)}: {status}")
            for ctx in contexts:
                self.records.append(ConfigRecord(cfg, ctx, status, str(e), cmd, str(log) if log else None))
            return
        with contextlib.ExitStack() as stack:
            stack.push(server_cm.__exit__)
            for ctx in contexts:
                rec = ConfigRecord(cfg, ctx, "ok", None, cmd, str(log) if log else None)
                self.records.append(rec)
                self._measure(rec, url, launched)
                if rec.status != "ok" and log is not None:
                    died = launched[0].death_note() if launched else ""
                    rec.error = (rec.error or "") + "\n" + (died or f"last lines of {log}:\n{tail(log)}")

    def _measure(self, rec: ConfigRecord, url: str, launched: list) -> None:
        from powerprof.sweep import PlacementStop, RunWriteError, Sweep, SweepError
        from powerprof.workload.client import ServerUnreachable
        from powerprof.workload.context import TokenizeError, context_prompt
        from powerprof.workload.load import detect
        from powerprof.workload.serverprocs import ServerProcesses
        from powerprof.workload.specdecode import spec_decode_counts

        try:
            server = detect(url, self.api)
            prompts = self.prompts
            if rec.context_tokens is not None:
                cp = context_prompt(server, rec.context_tokens)
                prompts, rec.prompt_tokens, rec.counted_by = [cp.prompt], cp.tokens, cp.counted_by
        except (ServerUnreachable, TokenizeError, OSError) as e:
            rec.status, rec.error = "failed", str(e)
            return
        look = self._check_placement(rec, url, launched)
        ref: list = []
        sweep = Sweep(
            self.settings, profiler=self.profiler, controller=self.controller, server=server, prompts=prompts,
            params=self.params, writer=_GridWriter(self, ref), timeline=self.timeline, run_id=self.run_id,
            reference_value=self.reference_value, ui=self.ui, row_extras=rec.columns(),
            # This configuration's server (its launch, its port): another process's kernels on the GPU are told from its.
            server_procs=ServerProcesses(url, launched), held_limits=self._held_limits, placement_look=look,
        )
        sweep.in_grid = True  # a stop under load says the grid stopped, and what of it is kept (Sweep._stop_words)
        ref.append((rec, sweep))
        if self.done or self.idle_power_w is not None:
            # One idle baseline for the grid: the GPU idles the same whichever server is loaded.
            sweep.s = _without_idle(self.settings)
            sweep.idle_power_w = self.idle_power_w
        before = spec_decode_counts(url) if server.kind == "vllm" else None
        try:
            sweep.run()
        except RunWriteError:
            raise  # the disk, not this configuration: the next one could not be stored either
        except PlacementStop as e:
            # A server GPU found under this configuration's load: the grid stops, as the check before it would have.
            rec.status, rec.error = "failed", str(e)
            raise
        except SweepError as e:
            rec.status, rec.error = "failed", str(e)
        finally:
            after = spec_decode_counts(url) if before is not None else None
            if before is not None and after is not None:
                rec.spec_metrics = (after[0] - before[0], after[1] - before[1])
            if self.idle_power_w is None:
                self.idle_power_w = sweep.idle_power_w
            self.done.append((rec, sweep))

    def _check_placement(self, rec: ConfigRecord, url: str, launched: list):
        """The GPUs this configuration's server runs on against the measured ones, once it answers and before it is
        measured (run_sweep's check ran before any configuration's server existed): a server GPU not measured (a
        CUDA_VISIBLE_DEVICES of the user's or the template's naming other GPUs) stops the grid, PlacementStop (sweep.py);
        run_sweep then puts every limit back and keeps the configurations finished. Returns the look again under this
        configuration's load (placement.LookUnderLoad), None where there is no GPU to look at."""
        from powerprof.sweep import PlacementStop
        from powerprof.workload.placement import (GpuPlacementError, LookUnderLoad, cost_words, find_placement,
                                                  judge_placement)
        from powerprof.workload.serverprocs import ServerProcesses

        src = self.rig.sources
        if src.nvml is None:
            return
        said: list[str] = []
        procs = ServerProcesses(url, launched)
        first = find_placement(src.nvml.nvml, src.gpu_uuids, procs)
        cost = cost_words(self.settings.level_kind)  # a grid steps clocks, limits or nothing: say what it leaves out
        try:
            judge_placement(first, said, allow=self.allow_unmeasured_server_gpus, cost=cost,
                            stopped="the grid stopped before measuring it (every limit put back, the configurations "
                                    "finished kept)")
        except GpuPlacementError as e:
            rec.status, rec.error = "failed", str(e)
            # A stop partway through the run, not a usage error: said as other mid-run stops are, exit 2.
            raise PlacementStop(f"configuration {rec.config_id}: {e}") from None
        self._note_placement(rec, said)
        return _GridLook(self, rec, LookUnderLoad(
            src.nvml.nvml, src.gpu_uuids, procs, first, allow=self.allow_unmeasured_server_gpus,
            stopped="the grid stopped at this configuration's first batch (every limit put back, the configurations "
                    "finished before it kept)", cost=cost, notes=list(said)))

    def _note_placement(self, rec: ConfigRecord, said: list[str]) -> None:
        for n in said:
            n = f"configuration {rec.config_id}: {n}"
            if n not in self.placement_notes:
                self.placement_notes.append(n)

    @property
    def foreign_notes(self) -> list[str]:
        """The sweeps' notes on others' work beside them (workload/others.py), each naming its configuration; what
        could not be ruled out, once for the grid."""
        out: list[str] = []
        for rec, sw in self.done:
            where = rec.config_id + (f", context {rec.context_tokens} tokens" if rec.context_tokens is not None else "")
            for note in sw.foreign_notes:
                if sw.others is not None and note in sw.others.cannot:
                    if note not in out:  # the same server kind says the same of every configuration
                        out.append(note)
                else:
                    out.append(f"configuration {where}: {note}")
        return out

    @property
    def restart_notes(self) -> list[str]:
        """The sweeps' notes on the idle baseline (one not kept: others' work beside it) and servers that went away,
        each naming its configuration."""
        return [f"configuration {rec.config_id}: {n}" for rec, sw in self.done for n in sw.restart_notes]

    # --- the run directory ------------------------------------------------------------------

    def windows_rows(self, current=None) -> list[dict]:
        pairs = list(self.done) + ([current] if current is not None and current not in self.done else [])
        return [r for _, sw in pairs for r in sw.rows]

    def _sweep_levels(self, rec: ConfigRecord, sw) -> list[dict]:
        from powerprof.workload.rows import spec_columns

        rows = []
        for row in sw.levels_table().to_pylist():
            at = [r for r in sw.rows if sw._counts(r) and r["level_value"] == row["level_value"]
                  and r["level_kind"] == row["level_kind"]]
            row.update(rec.columns(), config_status=rec.status, config_error=rec.error,
                       **spec_columns(at, rec.spec_metrics))
            rows.append(row)
        return rows

    def levels_rows(self, current=None) -> list[dict]:
        pairs = list(self.done) + ([current] if current is not None and current not in self.done else [])
        out = []
        for rec, sw in pairs:
            finished = (rec, sw) in self.done
            if finished and id(sw) not in self._finished_levels:
                self._finished_levels[id(sw)] = self._sweep_levels(rec, sw)  # a finished sweep's rows never change
            out.extend(self._finished_levels[id(sw)] if finished else self._sweep_levels(rec, sw))
            if not sw.rows or rec.status != "ok":
                if not any(r.get("config_id") == rec.config_id and r.get("context_tokens") == rec.context_tokens for r in out):
                    out.append({"run_id": self.run_id, **rec.columns(), "config_status": rec.status, "config_error": rec.error})
        measured = {id(rec) for rec, _ in pairs}
        for rec in self.records:
            if id(rec) not in measured and rec.status != "ok":
                out.append({"run_id": self.run_id, "level_kind": None, **rec.columns(), "config_status": rec.status,
                            "config_error": rec.error})
        return out

    def flush(self, current=None) -> None:
        from powerprof.sweep import run_write_error

        try:
            self._flush(current)
        except OSError as e:
            raise run_write_error(self.writer.path, e) from None

    def _flush(self, current=None) -> None:
        from powerprof.storage.schema import LEVELS, WINDOWS, rows_to_table, with_knob_columns

        w = self.windows_rows(current)
        lv = self.levels_rows(current)
        # Without it an interrupted level reads like a finished one (analysis interrupted_findings).
        pairs = list(self.done) + ([current] if current is not None and current not in self.done else [])
        levels_done = [(v.level_value, v.repeat, rec.config_id, rec.context_tokens)
                       for rec, sw in pairs for v in sw.visits if v.stop]
        # The grid's one idle baseline, left out for others' work beside it: run.json says so as a plain sweep's does.
        extra = {"idle_baseline_note": n for n in (sw.idle_note for _, sw in pairs) if n}
        extra.update(idle_gpu_power_w=self.idle_power_w, configs=[r.to_dict() for r in self.records],
                     levels_done=levels_done)
        # The footers say what run.json will (RunWriter.write): the rows they hold, no flush behind.
        self.writer.write("windows", with_knob_columns(rows_to_table(WINDOWS, w), w), coming=extra)
        self.writer.write("samples", self.timeline.to_table(), coming=extra)
        self.writer.write("levels", with_knob_columns(rows_to_table(LEVELS, lv), lv), coming=extra)
        self.writer.write_json(**extra)

    def levels_table(self):
        from powerprof.storage.schema import LEVELS, rows_to_table, with_knob_columns

        lv = self.levels_rows()
        return with_knob_columns(rows_to_table(LEVELS, lv), lv)


class _GridLook:
    """A configuration's LookUnderLoad, its refusal and notes named by the configuration, as its first check's are."""

    def __init__(self, grid: "GridRun", rec: ConfigRecord, look):
        self.grid, self.rec, self.look = grid, rec, look

    def rearm(self) -> None:
        self.look.rearm()  # the stop's "after its server restarted" is the sweep's (Sweep._look_rearmed)

    def __call__(self, since_wall_ns: int | None = None, stopped: str | None = None) -> list[str]:
        from powerprof.workload.placement import GpuPlacementError

        before = list(self.look.notes or [])
        # `stopped`: the configuration's sweep's words (Sweep._stop_words, in_grid): the level struck, this
        # configuration's finished levels kept (run_sweep writes them out: levels_done) and the configurations before
        # it. Before, they were replaced by "the configurations finished before it kept" alone, while levels_done
        # held this configuration's finished levels too. The configurations before it are the grid's (done: each
        # measured one's finished levels are written out whatever its status).
        if stopped is not None:
            # Only those that kept a finished level: a configuration that failed before finishing one is in `done` too
            # (appended whatever its status) and keeps nothing; counted, the words said more was kept than was.
            n = sum(1 for _, sw in self.grid.done if any(v.stop for v in sw.visits))
            stopped += (f", and the {n} configuration{'s' if n > 1 else ''} measured before it kept" if n
                        else ", no configuration before it kept a level" if self.grid.done
                        else ", no configuration before it")
        try:
            said = self.look(since_wall_ns, stopped=stopped)
        except GpuPlacementError as e:
            raise type(e)(f"configuration {self.rec.config_id}: {e}") from None
        # The look drops (or rewords) the first look's helper note for a GPU it finds serving: the grid's copy too.
        for n in before:
            if n not in (self.look.notes or []):
                gone = f"configuration {self.rec.config_id}: {n}"
                if gone in self.grid.placement_notes:
                    self.grid.placement_notes.remove(gone)
        self.grid._note_placement(self.rec, [n for n in self.look.notes or [] if n not in before] + said)
        return []  # the grid's placement_notes carry them into run.json


def run_grid(rig, spec: GridSpec, *, url: str, api: str | None = None, prompts=None, params=None,
             launch_timeout_s: float = 300.0, **sweep_kw):
    """`powerprof sweep --vary/--context-tokens`: `run_sweep` with a GridRun as its runner."""
    from functools import partial

    from powerprof.sweep import run_sweep
    from powerprof.workload.client import RequestParams
    from powerprof.workload.load import builtin_prompts

    prompts = prompts or builtin_prompts("short")
    params = params or RequestParams()
    runner = partial(GridRun, spec=spec, rig=rig, url=url, api=api, prompts=prompts, params=params,
                     launch_timeout_s=launch_timeout_s,
                     allow_unmeasured_server_gpus=sweep_kw.get("allow_unmeasured_server_gpus", False))
    return run_sweep(rig, url=url, launch=spec.template, api=api, prompts=prompts, params=params,
                     launch_timeout_s=launch_timeout_s, runner=runner, plan_lines=spec.plan_lines(), **sweep_kw)


def _without_idle(settings):
    from dataclasses import replace

    return replace(settings, idle_s=0.0)
