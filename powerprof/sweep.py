"""Sweep orchestration: per level set → settle → warm up → measure to the CI target; restore at the end."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from powerprof import termination
from powerprof import __version__
from powerprof.analysis import engine
from powerprof.analysis.stats import level_j_ci_halfwidth_frac, summarize_levels
from powerprof.collectors.clock_reasons import cap_not_engaged, thermal
from powerprof.collectors.cputime import (BUSY_HOST_FIX, BUSY_HOST_FLAG, BUSY_HOST_PCT, busy_host_text,
                                          unknown_server_text)
from powerprof.collectors.gateway import gateway
from powerprof.collectors.limitwatch import (CLOCK_FIX, LIMIT_CHANGERS, LIMIT_FIX, LIMIT_TOLERANCE_W,  # noqa: F401
                                            UNVOUCHED_FIX, ClockLockWatch, limit_moved, limits_read)  # (ClockLockWatch re-exported: tests)
from powerprof.control.device import read_devices
from powerprof.control.levels import parse_clock_levels, parse_power_levels
from powerprof.energy import COUNTER_STEP_S, short_counter_window_s
from powerprof.trust import out_dir_refusal
from powerprof.profiler import Profiler
from powerprof.storage.runs import RunWriter, claim_run_dir, default_run_dir, given_out_problem, table_from_rows
from powerprof.storage.samples import Timeline
from powerprof.workload.client import (CONTEXT_FIX, RequestParams, context_problem, health_status, identity_changes,
                                      new_session, restart_evidence, restart_said, server_away, server_epoch, server_identity)
from powerprof.workload.load import LoadAborted, LoadPolicy, builtin_prompts, detect, prompt_set_record, run_load_async
from powerprof.workload.placement import (GpuPlacementError, LookUnderLoad, cost_words, find_placement,
                                          judge_placement)
from powerprof.workload.others import FOREIGN_FIX, FOREIGN_FLAG, OthersWatch, leave_out_foreign
from powerprof.workload.rows import FIGURES, Level, request_timing, spec_columns, trace_row, window_rows
from powerprof.workload.servercount import ForeignWatch, settled_tally


@dataclass(frozen=True)
class SweepSettings:
    level_kind: str  # power_limit | sm_clock | none (the settings as they are: a configuration sweep alone)
    levels: tuple[float, ...]
    repeats: int = 1
    order: str = "desc"  # desc | asc | random
    seed: int = 0
    warmup_requests: int = 2
    min_requests: int = 5
    max_requests: int = 200
    max_time_s: float = 120.0
    target_ci: float = 0.02  # half-width of the 95% CI of J/token, as a fraction of the median
    # Also stop a level once its energy saving against the reference is known to ± this (a fraction:
    # 0.005 = ±0.5 percentage point), paired by prompt; None: only target_ci decides.
    target_paired_ci: float | None = None
    concurrency: int = 1
    idle_s: float = 5.0
    settle_timeout_s: float = 10.0
    settle_tolerance: float = 0.05
    max_failures: int = 10
    # A server that stops answering mid-level (restarted by systemd, a vLLM engine restarted) is waited for
    # this long, then the level is measured again from scratch; 0: the sweep stops, as for any failure.
    server_restart_wait_s: float = 120.0

    def __post_init__(self):
        if self.level_kind not in ("power_limit", "sm_clock", "none"):
            raise ValueError(f"unknown level kind {self.level_kind!r}")
        if self.order not in ("desc", "asc", "random"):
            raise ValueError(f"--order must be desc, asc or random, not {self.order!r}")
        if self.repeats < 1:
            raise ValueError("--repeats must be at least 1")
        if not 0 < self.target_ci < 1:
            raise ValueError("--target-ci must be a fraction between 0 and 1 (e.g. 0.02 for ±2%)")
        if self.target_paired_ci is not None and not 0 < self.target_paired_ci < 1:
            raise ValueError("--target-paired-ci must be a fraction between 0 and 1 (e.g. 0.005 for ±0.5 pp)")
        if self.min_requests < 2:
            raise ValueError("--min-requests must be at least 2: a confidence interval needs two requests")
        if self.max_requests < self.min_requests:
            raise ValueError("--max-requests must not be below --min-requests")
        if self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if not 0 <= self.server_restart_wait_s < float("inf"):
            raise ValueError("--server-restart-wait must be 0 (stop at once) or more seconds")


def visit_order(levels, repeats: int, order: str, seed: int = 0) -> list[tuple[float, int]]:
    """(level, repeat) in the order visited: every repeat passes over all levels (interleaved),
    so slow drift (temperature, background load) spreads over levels instead of biasing one."""
    rng = random.Random(seed)
    out: list[tuple[float, int]] = []
    for r in range(repeats):
        lv = list(levels)
        if order == "random":
            rng.shuffle(lv)
        else:
            lv.sort(reverse=(order == "desc"))
        out.extend((v, r) for v in lv)
    return out


def median_ci_halfwidth_frac(values: np.ndarray, level_value: float | None = None) -> float:
    """Half-width of the level's J/token 95% CI relative to its median: the very computation (same
    resamples) the table reports as ci_reached_pct, so the live figure and the table agree."""
    return level_j_ci_halfwidth_frac(values, level_value)


def stop_reason(j_per_token: np.ndarray, elapsed_s: float, s: SweepSettings, level_value: float | None = None,
                counter_window_s: float = float("nan"), refresh_s: float | None = COUNTER_STEP_S) -> str | None:
    """Why measuring this level can stop now, or None to go on. counter_window_s: the median decode window read on
    the energy counter (NaN: none); under 10 refreshes of it (refresh_s: the estimated refresh, None unknown: 100 ms;
    energy.short_counter_window_s) the windows share a bias the CI cannot see (the level is flagged short-windows),
    so a tight CI is no reason to stop: max-time or max-requests ends it."""
    n = int(np.isfinite(np.asarray(j_per_token, dtype=float)).sum())
    if n >= s.max_requests:
        return "max-requests"
    if elapsed_s >= s.max_time_s and n >= 2:
        return "max-time"
    if counter_window_s < short_counter_window_s(refresh_s):
        return None
    if n >= s.min_requests and median_ci_halfwidth_frac(j_per_token, level_value) <= s.target_ci:
        return "ci-reached"
    return None


def distrust(row: dict, why: str) -> None:
    """Mark a window untrusted with the reason: it keeps its record and loses its figures."""
    if row.get("status") != "ok":
        return
    row["timing"] = "untrusted"
    row["timing_reason"] = why
    row["energy_method"] = "none"
    for k in FIGURES:
        if k in row:
            row[k] = None


def _flag_levels(table, values, flag: str):
    """`flag` added to the `flags` of the levels rows whose level_value is in `values`.

    A level the sweep was still measuring when it stopped (a signal, an error, a server that went
    away) holds part of a round of the prompt set: levels.parquet says so itself, not only run.json."""
    if not values or table.num_rows == 0:
        return table
    import pyarrow as pa

    cut = {None if v is None else float(v) for v in values}
    flags = [
        ",".join(filter(None, [f, flag])) if v in cut else f
        for v, f in zip(table.column("level_value").to_pylist(), table.column("flags").to_pylist())
    ]
    i = table.schema.get_field_index("flags")
    return table.set_column(i, table.schema.field(i), pa.array(flags, table.schema.field(i).type))


def _level_name(visit) -> str:
    return "the settings as they are" if visit.level_value is None else f"level {visit.level_value:g}"


class SweepError(RuntimeError):
    """The sweep could not run or had to stop; the message says why. Limits are restored."""


class PlacementStop(SweepError):
    """The server runs on a GPU not measured, found partway through the run: by a grid configuration's check as its
    server started, or by the look under load after any batch of the sweep's (or a configuration's) (LookUnderLoad).
    The run stops as any mid-run stop does (limits put back, the finished configurations kept, none of the level the
    look stopped, the back line said), exit 2 (the --gpus given, or left out, are the mistake)."""

    exit_code = 2


class OutRefused(SweepError):
    """--out names no place a run folder can be made (its parent folder missing, a relative one from a removed current
    folder, inside a daemon's dataset or another run: storage.runs.given_out_problem): a usage error, exit 2, as every command's (storage.runs.missing_parent);
    nothing started, nothing changed."""

    exit_code = 2


class RunWriteError(SweepError):
    """The run's files could not be written (a full disk): the whole run stops, a grid's next configuration too."""


def run_write_error(path, e: OSError) -> RunWriteError:
    """A full disk (or a folder gone) mid-sweep, as a stop that says where the run is and that the GPUs are back, as
    for any failure. Each file is replaced whole or not at all, so run.json's levels_done still names the levels
    whose tables were written."""
    from powerprof.storage.runs import GONE_FIX, run_folder_gone, write_failure, write_fix

    if (gone := run_folder_gone(path)) is not None:
        # Said as a full disk with "the levels in run.json's levels_done were stored", of a folder rm -rf had taken.
        return RunWriteError(f"cannot write the run's tables to {path}: {write_failure(e)}: {gone}, so nothing of this "
                             f"run was kept; fix: {GONE_FIX}")
    return RunWriteError(f"cannot write the run's tables to {path}: {write_failure(e)}; the levels in run.json's "
                         f"levels_done were stored before it; fix: {write_fix(e)}")


@dataclass
class LevelVisit:
    """One pass over one level (a level is visited once per repeat)."""

    level_value: float
    repeat: int
    readback: object | None = None  # control.LimitReadback for power levels
    settle_s: float = 0.0
    spans: list[tuple[int, int]] = field(default_factory=list)  # measured decode spans, monotonic ns
    n_measured: int = 0
    n_untrusted: int = 0  # measured windows left out: their timing cannot be trusted
    stop: str | None = None
    elapsed_s: float = 0.0
    restarts: list[float] = field(default_factory=list)  # seconds the server was down, per time it was ridden out
    restarted: bool = False  # one of those times its process is known to have restarted (restart_evidence)
    foreign: list[str] = field(default_factory=list)  # why, per batch left out for others' work beside it
    foreign_windows: int = 0  # windows left out for it


# A server that restarts again and again within one level crashes under its load: waiting once more
# would only repeat it.
MAX_RESTARTS_PER_LEVEL = 3
RESTART_POLL_S = 0.5
# A level's last windows wait this long for a reading taken after them (a starved sampler's lag: ci4 saw ~1 s).
LEVEL_END_WAIT_PERIODS = 2
LEVEL_END_WAIT_S = 2.0
SETTING_WORDS = {"power_limit": "power limit", "sm_clock": "locked SM clock", "none": "power limits and clocks"}
RESTARTED_FLAG = "server-restarted"
AWAY_FLAG = "server-away"  # it stopped answering and was ridden out, with nothing to show it restarted


class UI:
    """What the sweep tells the user while it runs; the CLI passes a rich implementation."""

    def idle(self, seconds: float) -> None: ...
    def level_start(self, i: int, n: int, visit: LevelVisit, unit: str) -> None: ...
    def level_progress(self, visit: LevelVisit, live: dict) -> None: ...
    def level_done(self, visit: LevelVisit, live: dict) -> None: ...
    def note(self, text: str) -> None: ...

    def stopped(self, text: str) -> None:
        """The sweep stopped (a signal or an error): `text` says what was kept; nothing follows it."""
        self.note(text)


class Sweep:
    """Runs the levels. Owns nothing it did not create: the caller opens and closes the
    controller, profiler, server and writer (see run_sweep)."""

    def __init__(
        self,
        settings: SweepSettings,
        *,
        profiler: Profiler,
        controller,
        server,
        prompts,
        params,
        writer,
        timeline,
        run_id: str,
        reference_value: float | None,
        ui: UI | None = None,
        policy=None,
        row_extras: dict | None = None,
        server_procs=None,
        held_limits: dict | None = None,
        placement_look=None,
    ):
        """row_extras: columns every windows row carries (a configuration sweep's knobs). server_procs: a callable
        answering (the server's pids, None) or (None, why) (workload.serverprocs.ServerProcesses), to tell the
        server's processes on the GPUs from others'. held_limits: each GPU's (power limit, enforced limit) as the run
        began, filled at the first level when empty; a configuration sweep passes one for all its configurations.
        placement_look: the placement looked at again after every batch (workload/placement.LookUnderLoad): a server
        GPU found then stops the sweep, PlacementStop, before that batch's rows are kept."""
        self.s = settings
        self.row_extras = dict(row_extras or {})
        self.prof = profiler
        self.ctl = controller
        self.server = server
        self.prompts = list(prompts)
        self.params = params
        self.writer = writer
        self.timeline = timeline
        self.run_id = run_id
        self.reference_value = reference_value
        self.ui = ui or UI()
        self.policy = policy
        self.rows: list[dict] = []
        self.records: list[tuple[float, object]] = []  # (level value, RequestRecord): monotonic times
        self.visits: list[LevelVisit] = []
        self.idle_power_w: float | None = None
        self.idle_power_by_gpu_w: dict[str, float] | None = None  # {gpuN: W}: the baseline of each GPU
        self._rid = 0
        self._bid = 0
        self._prompt_k = 0
        self.unstored_rows = 0
        self._samples_seen = 0  # samples already checked for a setting that moved (_stop_if_setting_moved)
        self._clock_watch: ClockLockWatch | None = None
        self._reopened_before: list[int] = []  # the collector's reopen count per GPU as the level's watch began
        self._boost_mhz: dict[int, float] = {}  # GPU index → its highest busy SM clock this sweep (ClockLockWatch)
        # Levels that do not set the power limit (clocks, the settings as they are) run at the one the sweep found.
        self._held_limits: dict = held_limits if held_limits is not None else {}
        # Windows no reading taken after their end has vouched for yet: (rows, len(visit.spans) before them, end ns).
        # A sampler starved on a loaded host delivers a reading late; until one read after a window's end is judged,
        # the window may have run at a moved setting (_stop_if_setting_moved).
        self._suspect: list[tuple[list[dict], int, int]] = []
        self._t_watch_ns = 0  # when the level's watch began: readings taken before it are the last level's
        self._t_vouched_ns = 0  # the last reading that showed the level's setting held (no off-clock run open)
        self._attempt_rows: list[dict] = []  # the rows of the level's measurement in progress (since its start or a restart)
        self._identity: dict | None = None  # the server as the sweep began (server_identity), when restarts are ridden out
        self.restarts: list[dict] = []  # times the server went away and was ridden out: run.json `server_restarts`
        self._epoch: dict = {}  # the server process's marks (server_epoch) when last seen answering, for restart_evidence
        self.idle_note: str | None = None  # why there is no idle baseline, where one was attempted and not kept
        self._server_procs = server_procs
        self._placement_look = placement_look
        self._look_rearmed = False  # set once a server restart ridden out re-armed the look (_stop_words)
        # Set by a grid (GridRun) for its configurations' sweeps: the stop's words then say the grid stopped, this
        # configuration's finished levels and the configurations before it kept (_stop_words).
        self.in_grid = False
        self.placement_notes: list[str] = []  # the look under load's, with --allow-unmeasured-server-gpus
        # The server's books and the GPUs' processes against ours (workload/others.py); made with the session.
        self.others: OthersWatch | None = None

    # --- the run -----------------------------------------------------------------------------

    def run(self) -> None:

        termination.run(self._run())

    async def _run(self) -> None:

        if self.s.level_kind == "none":
            order = [(None, r) for r in range(self.s.repeats)]
        else:
            order = visit_order(self.s.levels, self.s.repeats, self.s.order, self.s.seed)
        async with new_session() as session:
            self.session = session
            self.others = OthersWatch(session, self.server.base_url, getattr(self.prof, "gpu", None), self._server_procs,
                                      kind=self.server.kind)
            if self.s.server_restart_wait_s > 0:
                self._identity = await server_identity(session, self.server)
            await self._idle_baseline()
            for i, (value, rep) in enumerate(order):
                visit = LevelVisit(value, rep)
                self.visits.append(visit)
                self._prompt_k = 0
                self._set_level(visit)
                unit = "W" if self.s.level_kind == "power_limit" else "MHz"
                self.ui.level_start(i, len(order), visit, unit)
                visit.settle_s = await self._settle(visit)
                await self._measure(visit)
                await self._judge_level_end(visit)
                self.flush()
                self.ui.level_done(visit, self._live(visit))

    async def _idle_baseline(self) -> None:
        """The GPU's idle power, with the server loaded and sent nothing. The server is watched throughout
        (/health every RESTART_POLL_S, its /metrics marks at both ends): one that restarts meanwhile reloads its
        model, which works the GPU far above idle, and that power must not become the baseline. It is taken
        again once the same server is back (--server-restart-wait), or left out, said, where it is not waited for."""
        if self.s.idle_s <= 0:
            return
        tries = 0
        while True:
            self.timeline.set_tags(level_kind="idle", level_value=None)
            self.ui.idle(self.s.idle_s)
            before = await server_epoch(self.session, self.server)
            tally0 = await settled_tally(self.session, self.server.base_url, self.server.kind)
            self.others.neighbours.mark()
            with self.prof.window("idle") as w:
                # Not waited for, the baseline keeps its length: the level after it finds the server as it would have.
                gone = await self._watch_health(self.s.idle_s, until_gone=self.s.server_restart_wait_s > 0)
            restarted, evidence = (None, "")
            if gone is None:
                restarted, evidence = restart_evidence(before, await server_epoch(self.session, self.server))
                if restarted:  # back between two probes: the reload may still have been in the window
                    gone = (time.monotonic_ns(), f"it restarted between two /health probes ({evidence})")
            if gone is None:
                e, dur_s = w.result.gpu_energy_total_j, w.result.duration_s
                self.idle_power_w = e / dur_s if e is not None and dur_s > 0 else None  # every GPU's together
                # Each GPU's own (run.json): a timeline of each GPU's power is read against its own idle, not the sum.
                self.idle_power_by_gpu_w = ({f"gpu{i}": ek / dur_s for i, ek in zip(self.prof.gpu.indexes, w.result.gpu_energy_j)}
                                            if self.idle_power_w is not None and self.prof.gpu else None)
                self._epoch = before
                books = ForeignWatch(tally0)
                others = books.judge(await settled_tally(self.session, self.server.base_url, self.server.kind), [])
                self.others.stale = self.others.stale or books.stale
                others = others or self.others.neighbours.check()
                if others:
                    self.idle_power_w = None
                    self.idle_note = (f"no idle baseline: others' work ran during it ({others}), so its power is not the "
                                      "idle GPU's; idle_gpu_power_w and every above-idle figure are left empty; fix: "
                                      + FOREIGN_FIX)
                    self.ui.note(self.idle_note)
                return
            t_gone_ns, why = gone
            name = "the idle baseline"
            if self.s.server_restart_wait_s <= 0:
                self.idle_power_w = self.idle_power_by_gpu_w = None
                self.idle_note = (
                    f"no idle baseline: the server stopped answering during it ({why}): a server restarting reloads its "
                    "model, which works the GPU, so that window's power is not the idle GPU's; idle_gpu_power_w and "
                    "every above-idle figure are left empty; fix: rerun with the server up throughout, or give "
                    "--server-restart-wait to have the baseline taken again once it is back")
                self.ui.note(self.idle_note)
                self.flush()
                return
            if tries >= MAX_RESTARTS_PER_LEVEL:
                self.flush()
                raise SweepError(
                    f"{name}: the server stopped answering again ({why}), its {tries + 1}th time before the first "
                    "level: fix: see why in the server's log (out of memory, a crash) and rerun")
            tries += 1
            self.ui.note(f"{name}: the server stopped answering ({why}); waiting up to {self.s.server_restart_wait_s:g} s "
                         "for it to come back (--server-restart-wait), then the baseline is taken again")
            down_s, restarted, evidence = await self._back(name, why, t_gone_ns, before, restarted, evidence)
            self._record_away(None, None, down_s, why, restarted, evidence, stage="idle-baseline")
            self.ui.note(f"{name}: {self._away_words(restarted, evidence, down_s)}; the baseline is taken again")

    async def _watch_health(self, seconds: float, until_gone: bool = True):
        """Sleep `seconds`, probing the server's /health every RESTART_POLL_S; (monotonic ns, why) of the first
        probe it did not answer 200 to, or None. A probe is a GET the server answers from memory: no GPU work.
        until_gone: return at that first probe rather than at the end."""
        deadline = time.monotonic() + seconds
        first = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return first
            await asyncio.sleep(min(RESTART_POLL_S, left))
            t_ns = time.monotonic_ns()
            st = await health_status(self.session, self.server.base_url)
            if st != 200 and first is None:
                first = t_ns, (f"{self.server.base_url}/health answered HTTP {st}" if st is not None
                               else f"{self.server.base_url}/health did not answer")
                if until_gone:
                    return first

    async def _back(self, name: str, why: str, t_gone_ns: int, before: dict, restarted=None, evidence: str = "",
                    recs=()):
        """Wait for the server that went away at `t_gone_ns` to be healthy again and check it is the same server;
        (seconds down, restarted: True/False/None, what says so). `before`: its server_epoch when last seen; `recs`:
        attempts since, a retry it answered says it was back by then. SweepError, with what was finished kept,
        when it is not back within the wait or is back as another server."""
        wait_s = self.s.server_restart_wait_s
        deadline = time.monotonic() + wait_s
        while await health_status(self.session, self.server.base_url) != 200:
            if time.monotonic() >= deadline:
                self.flush()
                raise SweepError(
                    f"{name}: the server stopped answering ({why}) and was not healthy again within {wait_s:g} s "
                    f"({self.server.base_url}/health); fix: see why in the server's log, or give it longer to come "
                    "back (--server-restart-wait SECONDS)")
            await asyncio.sleep(RESTART_POLL_S)
        answered = [r.t_send_ns for r in recs if r.ok and r.t_send_ns > t_gone_ns]
        down_s = ((min(answered) if answered else time.monotonic_ns()) - t_gone_ns) / 1e9
        after = await server_epoch(self.session, self.server)
        if restarted is None:
            restarted, evidence = restart_evidence(before, after)
        self._epoch = after
        try:
            changes = identity_changes(self._identity or {}, await server_identity(self.session, self.server))
        except Exception as e:  # noqa: BLE001 - it answered /health but not as a server: not the same one
            changes = [f"it no longer answers as an inference server ({e})"]
        if changes:
            self.flush()
            raise SweepError(
                f"{name}: the server came back after {down_s:.1f} s down, but not as the same server "
                f"({'; '.join(changes)}): the levels measured before and after would not be comparable; fix: "
                "restart it with the model, build and flags it had, and rerun the sweep")
        return down_s, restarted, evidence

    @staticmethod
    def _away_words(restarted, evidence: str, down_s: float) -> str:
        """What happened, only as far as the server shows it: a restart where its start time or counters say so."""
        what, why = restart_said(restarted, evidence)
        if restarted:
            return f"{what} ({why}) and is back after {down_s:.1f} s, the same server"
        return f"{what} ({why}; a connection reset or refused) and answers again after {down_s:.1f} s, the same server"

    def _record_away(self, visit, repeat, down_s, why, restarted, evidence, stage="level") -> None:
        value = None if visit is None else visit.level_value
        self.restarts.append({"stage": stage, "level_value": value, "repeat": repeat, "down_s": round(down_s, 3),
                              "error": why, "restarted": restarted, "evidence": evidence})
        self.flush()

    def _set_level(self, visit: LevelVisit) -> None:
        if self.s.level_kind == "none":
            self.timeline.set_tags(level_kind="none", level_value=None)
            return
        if self.s.level_kind == "power_limit":
            visit.readback = self.ctl.set_power_limit_w(visit.level_value)
        else:
            self.ctl.lock_sm_clock_mhz(int(visit.level_value))
        self.timeline.set_tags(level_kind=self.s.level_kind, level_value=float(visit.level_value))

    async def _settle(self, visit: LevelVisit) -> float:
        """Wait until the enforced limit reads back as set and power and SM clock hold steady
        across two reads, or the bounded wait runs out. Warm-up requests follow either way."""

        t0 = time.monotonic()
        prev = None
        while time.monotonic() - t0 < self.s.settle_timeout_s:
            now = self.prof.gpu.read()
            if prev is not None and all(self._steady(a, b, visit) for a, b in zip(prev, now)):
                break
            prev = now
            await asyncio.sleep(0.2)
        return time.monotonic() - t0

    def _steady(self, a, b, visit: LevelVisit) -> bool:
        tol = self.s.settle_tolerance
        if self.s.level_kind == "power_limit" and b.enforced_limit_w is not None:
            if abs(b.enforced_limit_w - visit.level_value) > max(2.0, tol * visit.level_value):
                return False
        for x, y in ((a.power_w or a.power_avg_w, b.power_w or b.power_avg_w), (a.sm_clock_mhz, b.sm_clock_mhz)):
            if x is not None and y is not None and abs(x - y) > tol * max(abs(x), 1e-9):
                return False
        return True

    def _next_prompts(self, n: int):
        # Every level walks the prompt set from its start, so request j of each level sends the same
        # prompt: with greedy decoding the levels then differ only by the setting, not by the text.
        k = self._prompt_k % len(self.prompts)
        self._prompt_k += n
        return self.prompts[k:] + self.prompts[:k]

    async def _batch(self, n_requests: int, warmup: int):

        try:
            recs = await run_load_async(
                self.server,
                self._next_prompts(n_requests),
                n_requests,
                self.s.concurrency,
                self.params,
                self.prof.edge,
                warmup,
                self.policy,
                self.session,
                self._rid,
                self._bid,
            )
        except LoadAborted as e:
            self._number_after(e.records)  # a level measured again after a restart goes on with new ids
            raise
        self._number_after(recs)
        # Answers the server cut short (its context full: llama.cpp stops where the slot fills, `truncated`): the
        # level's figures are then of shorter answers than asked. measure and sweep --trace said so; this kept it in
        # the request rows alone.
        cut = [r for r in recs if r.ok and r.truncated and not r.warmup]
        if cut:
            self.cut_count = getattr(self, "cut_count", 0) + len(cut)
            self.cut_first = getattr(self, "cut_first", None) or f"request {cut[0].request_id} ({cut[0].prompt_id}): {cut[0].truncated}"
        return recs

    @property
    def cut_notes(self) -> list[str]:
        n = getattr(self, "cut_count", 0)
        if not n:
            return []
        return [f"{n} request{'s were' if n != 1 else ' was'} cut short by the server's context ({self.cut_first}): their "
                f"levels' figures are of shorter answers than --max-tokens asked; {CONTEXT_FIX}"]

    def _number_after(self, recs) -> None:
        if recs:
            self._rid = max(r.request_id for r in recs) + 1
            bids = [r.batch_id for r in recs if r.batch_id is not None]
            self._bid = max(bids) + 1 if bids else self._bid

    def round_size(self) -> int:
        """Requests in one pass over the prompt set, in whole batches. A level stops only at the end
        of a round, so every level measures the same prompts the same number of times: with greedy
        decoding the levels then differ by the setting alone (a paired comparison)."""
        c = self.s.concurrency
        return -(-len(self.prompts) // c) * c

    async def _measure(self, visit: LevelVisit) -> None:

        self.policy = self.policy or LoadPolicy(max_failed_attempts=self.s.max_failures)
        t_start = time.monotonic()
        warmup = self.s.warmup_requests
        jpt: list[float] = []
        counter_s: list[float] = []  # decode_s of the windows read on the energy counter (stop_reason)
        attempted = 0
        self._watch_from_now(visit)
        self._attempt_rows = []
        if self.s.server_restart_wait_s > 0:
            self._epoch = await server_epoch(self.session, self.server)  # what a restart mid-level is told by
        await self._watch_others()
        foreign_sent = 0
        while True:
            try:
                recs, aborted = await self._batch(self.s.concurrency, warmup), None
            except LoadAborted as e:
                recs, aborted = e.records, e
            if self.s.server_restart_wait_s > 0 and any(server_away(r) for r in recs):
                self._add_rows(visit, recs)
                await self._ride_out(visit, recs)
                if self._placement_look is not None:
                    # The restarted server has not been looked at under load (it may have come back placed
                    # otherwise, a small model on another GPU): its first batch's look is a full one.
                    self._placement_look.rearm()
                    self._look_rearmed = True  # its stop now says the level and the finished levels kept (_stop_words)
                # Measured again from scratch, as the level began: warm-up, the prompt set from its start.
                t_start, warmup, jpt, attempted, foreign_sent = time.monotonic(), self.s.warmup_requests, [], 0, 0
                counter_s = []
                self._prompt_k = 0
                await self._watch_others()
                continue
            if aborted is not None:
                self._add_rows(visit, recs)
                self.flush()
                raise SweepError(f"{_level_name(visit)}: {aborted}") from None
            # Before the batch's rows are kept: a refusal keeps none of a wrongly scoped level.
            self._look_again(min((r.t_send_wall_ns for r in recs), default=None), visit)
            if warmup:
                # --max-time counts from the end of the warm-up (its --help says so): counted, it took the slowest
                # level's time budget first, and that level got the fewest windows.
                warm_end = max((r.t_end_ns for r in recs if r.warmup and r.t_end_ns), default=None)
                if warm_end is not None:
                    t_start = warm_end / 1e9
            warmup = 0
            spans_before = len(visit.spans)
            new = self._add_rows(visit, recs)
            self._stop_if_setting_moved(visit, new, spans_before, max((r.t_end_ns for r in recs if r.t_end_ns), default=time.monotonic_ns()))
            others = await self._others_beside(recs)
            if others:
                # Left out and the same prompts sent again, so the level still measures whole rounds (paired).
                for row in new:
                    if row.get("status") == "ok":
                        leave_out_foreign(row, others)
                        visit.foreign_windows += self._measured(row)
                del visit.spans[spans_before:]
                visit.foreign.append(others)
                self._prompt_k -= self.s.concurrency
                foreign_sent += self.s.concurrency
                visit.elapsed_s = time.monotonic() - t_start
                self.ui.level_progress(visit, self._live(visit))
                # Left-out batches have their own budget, as many requests again as the level's: others at work
                # all along cannot stall the sweep, and a burst of theirs costs the level no measured request.
                if foreign_sent >= self.s.max_requests or visit.elapsed_s >= self.s.max_time_s:
                    visit.stop = "foreign-traffic"  # others' work went on for the level's whole budget
                    return
                continue
            attempted += self.s.concurrency
            for row in new:
                if self._counts(row):
                    jpt.append(row["gpu_j_per_token"] if row["gpu_j_per_token"] is not None else np.nan)
                    if row["gpu_j_per_token"] is not None and "counter" in str(row.get("energy_method") or "").split(",") \
                            and row.get("decode_s"):
                        counter_s.append(float(row["decode_s"]))
                    visit.n_measured += 1
                elif self._measured(row):
                    visit.n_untrusted += 1
            visit.elapsed_s = time.monotonic() - t_start
            self.ui.level_progress(visit, self._live(visit))
            if attempted % self.round_size():
                continue
            if visit.n_measured == 0 and visit.n_untrusted >= self.s.min_requests:
                ex = self.excluded()
                self.flush()
                raise SweepError(f"{_level_name(visit)}: no window could be trusted: {ex.message() if ex else ''}")
            cw = float(np.median(counter_s)) if counter_s else float("nan")
            refresh = self._counter_refresh_s()
            visit.stop = (stop_reason(np.asarray(jpt, dtype=float), visit.elapsed_s, self.s, visit.level_value, cw, refresh)
                          or (None if cw < short_counter_window_s(refresh) else self._paired_stop(visit)))
            if visit.stop is None and attempted >= self.s.max_requests:
                visit.stop = "max-requests"  # untrusted windows count against the budget too
            if visit.stop is None and not np.isfinite(jpt).any() and visit.n_measured >= self.s.min_requests:
                visit.stop = "no-energy"  # no GPU energy readable: J/token can never converge
            if visit.stop:
                return

    def _look_again(self, since_wall_ns: int | None, visit: LevelVisit | None = None) -> None:
        """The server's GPUs once more, now that a batch has run (every batch: LookUnderLoad): a small model idle
        before the load was taken for a helper, and its GPU left unmeasured; where the load's requests worked it, the
        sweep stops (PlacementStop, exit 2: run_sweep puts every limit back) or, allowed, says so in its notes."""
        if self._placement_look is None:
            return
        try:
            # Every batch is looked at: the stop says the level it struck and the finished levels kept (_stop_words),
            # not the look's words fixed when it was made ("its first level, none of it kept").
            said = self._placement_look(since_wall_ns, stopped=self._stop_words(visit) if visit is not None else None)
            self.placement_notes.extend(said)
        except GpuPlacementError as e:
            raise PlacementStop(str(e)) from None

    def _stop_words(self, visit: LevelVisit) -> str:
        """What a stop by the look under load at `visit` (after a server restart, if one was ridden out) leaves: that
        visit, none of it kept, and the visits finished before it, kept (run_sweep puts every limit back). With
        --repeats a level is visited once a pass: the visit is named by its repeat, and the finished ones by level and
        repeat, since an earlier pass of the level struck is kept (levels_done); named by level alone, a stop at a
        level's second visit said "none of that level kept" and listed that level kept. In a grid (in_grid), the grid
        stopped, and this configuration's finished levels are kept (the configurations before it: grid._GridLook)."""
        unit = {"power_limit": " W", "sm_clock": " MHz"}.get(self.s.level_kind, "")
        reps = self.s.repeats > 1
        level = "the settings as they are" if visit.level_value is None else f"level {visit.level_value:g}{unit}"
        if reps:
            level += f" (repeat {visit.repeat + 1})"
        by_level: dict = {}
        for v in self.visits:
            if v.stop and v.level_value is not None and v is not visit:
                by_level.setdefault(v.level_value, []).append(v.repeat + 1)
        done = sorted(by_level)
        if reps:
            names = [f"{x:g}{unit} (repeat{'s' if len(by_level[x]) > 1 else ''} "
                     f"{', '.join(map(str, sorted(by_level[x])))})" for x in done]
        else:
            names = [f"{x:g}" for x in done]
        what = "visit" if reps else "level"
        listed = "; ".join(names) if reps else f"{', '.join(names)}{unit}"
        its = "this configuration's " if self.in_grid else "the "
        kept = (f"{its}finished {what}{'s' if sum(map(len, by_level.values())) > 1 else ''} ({listed}) kept"
                if done else f"no {what}{' of this configuration' if self.in_grid else ''} had finished")
        after = ", after its server restarted" if self._look_rearmed else ""
        if self.in_grid:
            # The configurations before it are the grid's to say (grid._GridLook).
            return f"the grid stopped at this configuration's {level}{after} (every limit put back): none of that {what} kept, {kept}"
        return f"the sweep stopped at {level}{after}: none of that {what} kept, {kept}"

    async def _watch_others(self) -> None:
        """Begin comparing the server's books with our requests, and the GPUs' processes with the server's, from now."""
        await self.others.begin()

    async def _others_beside(self, recs) -> str | None:
        """Why the batch `recs` (just finished: none of ours in flight) ran beside others' work, or None
        (workload/others.py: the server's books, the GPUs' processes)."""
        return await self.others.judge(recs)

    @property
    def foreign_notes(self) -> list[str]:
        """Levels measured beside others' work (flag foreign-traffic), what was seen and the fix; once, what could not be
        ruled out."""
        out = []
        hit = [v for v in self.visits if v.foreign]
        if self.others is None:
            return out
        if hit:
            saw = self.others.saw()
            where = "; ".join(
                f"{_level_name(v)}" + (f" (repeat {v.repeat + 1})" if self.s.repeats > 1 else "")
                + f": {len(v.foreign)} batch(es) ({v.foreign_windows} measured windows), first because {v.foreign[0]}"
                + (" - the level's budget ran out with others still at work: its figures rest on the windows without "
                   "them, an incomplete round" if v.stop == "foreign-traffic" else "")
                for v in hit)
            out.append(f"others' work ran beside the sweep (flag {FOREIGN_FLAG}): powerprof saw {saw or 'it'} not its "
                       f"own. {where}. Those windows are left out of every figure and their prompts measured again; "
                       f"fix: {FOREIGN_FIX}")
        return out + self.others.cannot

    async def _ride_out(self, visit: LevelVisit, recs) -> None:
        """The server stopped answering mid-level (`recs` say so: server_away): wait for it to be healthy again,
        check it came back the same server, and leave out every window of the level measured so far, so the
        caller measures it again from scratch. SweepError, with the finished levels kept, when it does not
        come back within the wait, comes back different, or goes away too often."""
        name = _level_name(visit)
        gone = [r for r in recs if server_away(r)]
        t_gone_ns, why = min(r.t_send_ns for r in gone), gone[0].error
        wait_s = self.s.server_restart_wait_s
        if len(visit.restarts) >= MAX_RESTARTS_PER_LEVEL:
            self.flush()
            raise SweepError(
                f"{name}: the server stopped answering again ({why}), its {len(visit.restarts) + 1}th time during this "
                "level: it fails under this load or at this setting, and measuring it again would only repeat that; "
                "fix: see why in the server's log (out of memory, a crash) and rerun")
        self.ui.note(f"{name}: the server stopped answering ({why}); waiting up to {wait_s:g} s for it to come back "
                     "(--server-restart-wait)")
        down_s, restarted, evidence = await self._back(name, why, t_gone_ns, self._epoch, recs=recs)
        what = "restarted" if restarted else "stopped answering"
        left = (f"measured before the server {what} mid-level (down {down_s:.1f} s): the level was measured again "
                "from scratch")
        for row in self._attempt_rows:
            if row.get("timing") != "untrusted":
                distrust(row, left)
        self._attempt_rows = []
        visit.spans.clear()
        self._suspect = []
        visit.n_measured = visit.n_untrusted = 0
        visit.restarts.append(down_s)
        visit.restarted = visit.restarted or bool(restarted)
        self._record_away(visit, visit.repeat, down_s, why, restarted, evidence)
        self.ui.note(f"{name}: {self._away_words(restarted, evidence, down_s)}; the level is measured again from "
                     "scratch (warm-up first), its windows so far left out")
        visit.settle_s += await self._settle(visit)

    @property
    def restart_notes(self) -> list[str]:
        """One line per time the server went away and was ridden out, for the end screen and run.json notes."""
        unit = "W" if self.s.level_kind == "power_limit" else "MHz"
        out = []
        for r in self.restarts:
            restarted = r.get("restarted")
            what, why = restart_said(restarted, r.get("evidence"))
            seen = f"({why})"
            if r.get("stage") == "idle-baseline":
                out.append(f"{what} during the idle baseline {seen}, down {r['down_s']:.1f} s ({r['error']}): the "
                           "baseline was taken again once it was back, so no reload of its model is in idle_gpu_power_w")
                continue
            where = "the settings as they are" if r["level_value"] is None else f"level {r['level_value']:g} {unit}"
            rep = f" (repeat {r['repeat'] + 1})" if self.s.repeats > 1 else ""
            flag = RESTARTED_FLAG if restarted else AWAY_FLAG
            out.append(f"{what} at {where}{rep} {seen}, down {r['down_s']:.1f} s ({r['error']}): the level was "
                       f"measured again from scratch after a warm-up; the windows measured before are left out "
                       f"(levels.parquet flag {flag})")
        return out + ([self.idle_note] if self.idle_note else [])

    def _watch_from_now(self, visit: LevelVisit) -> None:
        """The level's setting is checked in every GPU sample from here on (settled or not)."""
        self._samples_seen = len(self.timeline)
        self._reopened_before = list(getattr(self.prof.gpu, "reopened", []) or [])
        if self.s.level_kind != "power_limit" and not self._held_limits and self.prof.gpu is not None:
            self._held_limits.update(limits_read(self.prof.gpu.read()))
        self._suspect, self._t_watch_ns, self._t_vouched_ns = [], time.monotonic_ns(), 0
        locked = self.s.level_kind == "sm_clock" and visit.level_value is not None
        # Without a lock of ours, the GPU's busy clock so far this sweep is what a clock set below it betrays.
        self._clock_watch = ClockLockWatch(visit.level_value if locked else None, boost_mhz=self._boost_mhz)

    def _new_gpu_samples(self) -> list:
        items = self.timeline.samples()
        new, self._samples_seen = items[self._samples_seen:], len(items)
        # A reading taken before the watch began (delivered late by a starved sampler) shows the last level's setting.
        return [smp for smp in new if smp.source == "nvml" and smp.data and smp.t_mono_ns >= self._t_watch_ns]

    def _limit_problem(self, visit: LevelVisit, samples) -> str | None:
        """Why the level's power limit did not hold in `samples` (taken since the last check), or None.

        Another tool (nvidia-smi -pl, a DCGM policy, a power manager) may set the limit mid-level: the
        windows after it ran at its limit, not the level's, and would be filed under the level. A level
        that sets no limit (a locked clock, the settings as they are) runs at the limits the sweep found,
        each GPU's own: a cap lowered under it slowed the clock and the figures as much (the settings'
        level: -22% J/token, unflagged), and a configuration sweep's configurations were compared across it."""
        set_w = float(visit.level_value) if self.s.level_kind == "power_limit" and visit.level_value is not None else None
        tol = float(getattr(self.ctl, "tolerance_w", LIMIT_TOLERANCE_W))
        for smp in samples:
            expected = {r.index: (set_w, set_w) for r in smp.data} if set_w is not None else self._held_limits
            m = limit_moved(smp.data, expected, tol)
            if m is not None:
                return (f"GPU {m.index}'s {m.what} read {m.read_w:g} W during the level, not "
                        + (f"the {set_w:g} W set: another tool changed it ({LIMIT_CHANGERS}) or the driver lowered it"
                           if set_w is not None else
                           f"the {m.expected_w:g} W it read as the sweep began: another tool changed it ({LIMIT_CHANGERS}), "
                           "a GPU reset put its default back, or the driver lowered it")
                        + "; the windows measured since are left out of every figure")
        return None

    def _gpu_gone_problem(self) -> str | None:
        """Why a GPU's setting cannot be vouched for since the level's watch began, or None: the GPU stopped
        answering (off the bus, or its handle stale after a reset) or was reopened after a reset. A reset puts
        the default power limit back and releases clock locks, and the readings across it are missing: the
        windows after it ran at whatever the reset left, which the limit and clock checks would see only once
        the GPU answers again, if before the level ends."""
        gpu = self.prof.gpu
        if gpu is None or self.s.level_kind == "none":
            return None
        reopened = list(getattr(gpu, "reopened", []) or [])
        for k, i in enumerate(getattr(gpu, "indexes", [])):
            before = self._reopened_before[k] if k < len(self._reopened_before) else 0
            if k < len(reopened) and reopened[k] > before:
                return (f"GPU {i} was reset during the level (its NVML handle went stale; powerprof reopened it by its "
                        "UUID): a reset puts the default power limit back and releases clock locks, so the level's "
                        "setting did not hold; the windows measured since are left out of every figure")
            lost = getattr(gpu, "lost", {}).get(i)
            if lost:
                return (f"GPU {i} stopped answering during the level ({lost}), so the level's setting cannot be "
                        "vouched for; the windows measured since are left out of every figure")
        return None

    def _setting_problem(self, visit: LevelVisit, samples) -> tuple[str, str] | None:
        """(why, fix) when the level's power limit or SM clock did not hold in `samples` (taken since the last
        check, in the order read), or None; every reading that showed it held with no off-clock run open
        advances `_t_vouched_ns`."""
        for smp in samples:
            why = self._limit_problem(visit, [smp])
            if why is not None:
                return why, LIMIT_FIX
            for r in smp.data if self._clock_watch is not None else ():
                why = self._clock_watch.feed(r)
                if why:
                    return why, CLOCK_FIX
            if self._clock_watch is None or not self._clock_watch.open:
                self._t_vouched_ns = max(self._t_vouched_ns, smp.t_mono_ns)
        return None

    def _stop_if_setting_moved(self, visit: LevelVisit, rows: list[dict], spans_before: int, t_end_ns: int) -> None:
        """Leave windows out and stop the sweep when the level's power limit or locked clock did not hold in
        the samples taken since the last check. `rows` ended at `t_end_ns`; `spans_before`: len(visit.spans)
        before they added theirs. A window is vouched for only by a reading taken after it ended (with no
        run of off-clock readings open): until then it waits, so a reading delivered late still leaves it
        out, with its spans, which would otherwise feed the level's sensor figures (SM clock, thermal, ...)."""
        if rows:
            self._suspect.append((list(rows), spans_before, t_end_ns))
        samples = self._new_gpu_samples()
        why = self._gpu_gone_problem()
        if why is not None:
            fix = ("find what reset or lost the GPU (`dmesg | grep -i xid`; nvidia-smi -r or a driver reload in a script, "
                   "a cluster health check) and rerun")
        else:
            problem = self._setting_problem(visit, samples)
            if problem is None:
                self._suspect = [s for s in self._suspect if s[2] > self._t_vouched_ns]
                return
            why, fix = problem
        left = [row for s in self._suspect for row in s[0]]
        if self._suspect:
            del visit.spans[self._suspect[0][1]:]
        self._suspect = []
        for row in left:
            distrust(row, why)
        visit.stop = None  # judged at its end (_judge_level_end), the level did not finish: it is `interrupted`
        self.flush()
        raise SweepError(f"{_level_name(visit)}: {why}; fix: {fix}")

    async def _judge_level_end(self, visit: LevelVisit) -> None:
        """Wait (bounded) for a reading taken after the level's last window and judge it: a sampler late on a
        loaded host would otherwise let the level end with its last windows never checked."""
        if not self._suspect or getattr(self.prof, "gpu", None) is None:
            return  # nothing waits, or no GPU is read: no reading will ever come to judge by
        t_end = self._suspect[-1][2]
        interval_s = getattr(getattr(self.prof, "sampler", None), "interval_ns", 1e9) / 1e9
        deadline = time.monotonic() + LEVEL_END_WAIT_PERIODS * interval_s + LEVEL_END_WAIT_S
        while time.monotonic() < deadline:
            # A tick a starved sampler missed is published empty: it vouches for nothing (_new_gpu_samples).
            if any(smp.t_mono_ns >= t_end and smp.data for smp in self.timeline.samples("nvml")[-4:]):
                break
            await asyncio.sleep(min(0.05, interval_s / 4))
        self._stop_if_setting_moved(visit, [], len(visit.spans), t_end)
        if self._suspect:
            self._leave_out_unvouched(visit, LEVEL_END_WAIT_PERIODS * interval_s + LEVEL_END_WAIT_S)

    def _leave_out_unvouched(self, visit: LevelVisit, waited_s: float) -> None:
        """Leave out, said, the windows still waiting at the level's end: no reading taken after they ended came
        within the wait, or the last busy ones read the clock off the level's, so a limit or clock moved in them
        would go unseen (the next level's setting is about to replace it, and the readings that could tell arrive
        under that level)."""
        # A window left out already (untrusted, or beside others' work: counted in foreign_windows) keeps its one
        # reason: marked again, it was counted under both, in n_untrusted too.
        rows = [row for s in self._suspect for row in s[0]
                if row.get("timing") != "untrusted" and not row.get("foreign_traffic")]
        del visit.spans[self._suspect[0][1]:]
        self._suspect = []
        if self._clock_watch is not None and self._clock_watch.open:
            # The GPU idles once the level's requests end, and an idle reading says nothing of a clock: the run of
            # off-clock busy readings is left open, too short to call the setting moved and never settled.
            # A level that locks no clock is held to the busy clock the GPU showed earlier (ClockLockWatch): it has none.
            off = ("off the level's" if self._clock_watch.locked_mhz is not None else
                   "below the busy clock it showed earlier in the sweep, with no power or thermal limit named")
            why, fix = (f"the GPU's last busy readings after this window ended showed its SM clock {off}, too "
                        "few in a row to call the setting moved and none back on it before the level ended, so the "
                        f"level's {SETTING_WORDS.get(self.s.level_kind, 'setting')} cannot be vouched for in it"), CLOCK_FIX
        else:
            why = (f"no GPU reading taken after this window ended arrived within {waited_s:.1f} s of the level's end "
                   f"(the sampler lagged behind, a loaded host), so the level's "
                   f"{SETTING_WORDS.get(self.s.level_kind, 'setting')} cannot be vouched for in it")
            fix = UNVOUCHED_FIX
        n = 0
        for row in rows:
            if self._counts(row):
                visit.n_measured -= 1
                n += 1
            if self._measured(row):
                visit.n_untrusted += 1
            distrust(row, why)
        if n:
            self.ui.note(f"{_level_name(visit)}: {n} window(s) left out of every figure: {why}; fix: {fix}")

    def _counter_refresh_s(self) -> float | None:
        """The energy counter's refresh estimated from the run's reads so far (None: not yet known, or no profiler)."""
        tl = getattr(self.prof, "timeline", None)
        return tl.counter_refresh_s() if tl is not None and hasattr(tl, "counter_refresh_s") else None

    def _paired_stop(self, visit: LevelVisit) -> str | None:
        """'paired-ci-reached' when this level's saving against the reference (already measured in
        this pass) is known to ±target_paired_ci, paired by prompt (analysis.stats)."""
        from powerprof.analysis.stats import choose_reference, paired_saving_halfwidth

        if self.s.target_paired_ci is None or len(self.s.levels) < 2 or visit.level_value is None:
            return None  # no target, or nothing to compare with (one level, or the settings as they are)
        ref = self.s.levels[choose_reference(self.s.levels, self.reference_value)]  # as the analysis picks it
        if ref is None or float(visit.level_value) == float(ref):
            return None
        if visit.n_measured < self.s.min_requests:
            return None

        def level(value):
            rows = [r for r in self.rows if r["level_value"] == float(value) and r["repeat"] == visit.repeat and self._counts(r)]
            return [r["gpu_j_per_token"] if r["gpu_j_per_token"] is not None else np.nan for r in rows], [r["prompt_id"] for r in rows]

        ref_j, ref_p = level(ref)
        if not ref_j:
            return None  # the reference comes later in this pass: only the level's own CI can decide
        lvl_j, lvl_p = level(visit.level_value)
        hw = paired_saving_halfwidth(ref_j, ref_p, lvl_j, lvl_p)
        return "paired-ci-reached" if hw <= self.s.target_paired_ci else None

    def _measured(self, row: dict) -> bool:
        kind = "request" if self.s.concurrency == 1 else "batch"
        return row["window_kind"] == kind and not row["warmup"] and row["status"] == "ok"

    def _counts(self, row: dict) -> bool:
        """A window the level's figures use: measured, timed by a rule that can be trusted, and not beside others' work."""
        return self._measured(row) and row.get("timing") != "untrusted" and not row.get("foreign_traffic")

    def excluded(self):
        """Measured windows the figures left out (untrusted timing), for the notes; None if none."""
        from powerprof.workload.measure import excluded_windows

        kind = "request" if self.s.concurrency == 1 else "batch"
        return excluded_windows(self.rows, counted_kind=lambda r: kind)

    def _add_rows(self, visit: LevelVisit, recs) -> list[dict]:
        value = None if visit.level_value is None else float(visit.level_value)
        level = Level(self.s.level_kind, value, visit.repeat)
        new, batches = window_rows(recs, self.prof, self.run_id, self.server, level)
        for row in new:
            row.update(self.row_extras)
        for r in recs:
            self.records.append((visit.level_value, r))
            _, edges = request_timing(r)
            if edges is not None and not r.warmup and self.s.concurrency == 1:
                visit.spans.append(edges)
        for b, row in zip(batches, [x for x in new if x["window_kind"] == "batch"]):
            if row.get("timing") != "untrusted":
                visit.spans.extend((int(t0), int(t1)) for t0, t1 in b.intervals)
        for row in new:
            self._above_idle(row)
        self.rows.extend(new)
        self._attempt_rows.extend(new)
        return new

    def _above_idle(self, row: dict) -> None:
        row["idle_gpu_power_w"] = self.idle_power_w
        e, d, n = row.get("gpu_energy_j"), row.get("decode_s"), row.get("decode_tokens")
        if self.idle_power_w is not None and e is not None and d and n and not row.get("shared_window"):
            row["above_idle_gpu_j_per_token"] = (e - self.idle_power_w * d) / n

    def _live(self, visit: LevelVisit) -> dict:
        rows = [r for r in self.rows if r["level_value"] == visit.level_value and r["repeat"] == visit.repeat and self._counts(r)]
        rates = [r["decode_tok_s"] for r in rows if r["decode_tok_s"]]
        jpt = np.asarray([r["gpu_j_per_token"] for r in rows if r["gpu_j_per_token"] is not None], dtype=float)
        pw = [r["avg_gpu_power_w"] for r in rows if r["avg_gpu_power_w"] is not None]
        return {
            "requests": visit.n_measured,
            "tok_s": float(np.median(rates)) if rates else None,
            "power_w": float(np.mean(pw)) if pw else None,
            "j_per_token": float(np.median(jpt)) if jpt.size else None,
            "ci_pct": 100 * median_ci_halfwidth_frac(jpt, visit.level_value) if jpt.size >= 2 else None,
            "stop": visit.stop,
        }

    # --- output ------------------------------------------------------------------------------

    def level_extras(self, samples=None) -> dict:
        """Sensor-derived figures per level for levels.parquet (the windows give the rest).

        samples: the run's samples table (the one flush writes); the figures come from the same
        implementation the analysis runs over samples.parquet (analysis/engine.py)."""
        samples = self.timeline.to_table() if samples is None else samples
        t0 = self.timeline.t0_mono_ns or 0
        spans = [sp for v in self.visits for sp in v.spans]
        starts, ends = engine.merge_intervals(np.array([(a - t0) / 1e9 for a, _ in spans], float),
                                              np.array([(b - t0) / 1e9 for _, b in spans], float))
        with engine.connect() as con:
            sums = engine.level_sums(con, engine.samples_relation(con, samples), (starts, ends), time_expr="t_mono_s")
        figures = engine.level_figures(sums)
        out = {}
        n_gpus = len(self.prof.gpu.indexes) if self.prof.gpu else 1
        for value in sorted({v.level_value for v in self.visits}, key=lambda v: -1.0 if v is None else v):
            visits = [v for v in self.visits if v.level_value == value]
            st = figures.get((self.s.level_kind, None if value is None else float(value)), {})
            rows = [r for r in self.rows if r["level_value"] == value and self._counts(r)]
            e = [r["gpu_energy_j"] for r in rows if r["gpu_energy_j"] is not None]
            c = [r["cpu_energy_j"] for r in rows if r["cpu_energy_j"] is not None]
            d = sum(r["decode_s"] or 0 for r in rows if r["gpu_energy_j"] is not None)
            dc = sum(r["decode_s"] or 0 for r in rows if r["cpu_energy_j"] is not None)
            avg_w = sum(e) / d if e and d > 0 else None
            rb = [v.readback for v in visits if v.readback is not None]
            # One figure for all GPUs: they agree within the controller's tolerance, or the set refused and
            # restored (check_applied), or the level's windows were left out (_limit_problem).
            enforced = float(np.mean([g.enforced_w for b in rb for g in b.gpus])) if rb else None
            requested = float(value) if self.s.level_kind == "power_limit" else None
            loose = None
            if self.s.level_kind != "power_limit":
                not_engaged = False
            elif n_gpus == 1:
                not_engaged = cap_not_engaged(avg_w, enforced or requested, st.get("clock_event_reasons"))
            else:  # judged on each GPU: one at its cap beside one far under it is neither
                level_sums = sums.get((self.s.level_kind, None if value is None else float(value)), engine.LevelSums())
                not_engaged, loose = engine.cap_by_gpu(self._per_gpu_cap_figures(visits, rb, requested, level_sums))
            # (kind, value): one run's sensors, whatever concurrency its windows say (stats.level_extra).
            out[(self.s.level_kind, None if value is None else float(value))] = {
                "requested_limit_w": requested,
                "enforced_limit_w": enforced,
                "locked_sm_clock_mhz": float(value) if self.s.level_kind == "sm_clock" else None,
                # avg_gpu_power_w stays the windows' median (docs/data.md), as analysis.parquet has it:
                # the energy-weighted mean above only feeds the cap rule.
                "avg_cpu_power_w": sum(c) / dc if c and dc > 0 else None,
                "sm_clock_mhz": st.get("sm_clock_mhz"),
                "mem_clock_mhz": st.get("mem_clock_mhz"),
                "no_busy_clock": st.get("no_busy_clock"),  # the flag saying why the two above are empty
                "cap_not_engaged": not_engaged,
                "cap_not_engaged_gpus": loose,
                "thermal_throttle": thermal(st.get("clock_event_reasons")),
                "stop_rule": ",".join(dict.fromkeys(v.stop for v in visits if v.stop)) or None,
                # Speculative decoding's drafts over the level's measured windows (a configuration sweep's may
                # come from the server's counters instead: grid.py).
                **spec_columns(rows, None),
                # The refresh the short-windows flag counts in (analysis.stats): the run's estimate, null unknown.
                "counter_refresh_s": self._counter_refresh_s(),
            }
        return out

    def _per_gpu_cap_figures(self, visits, readbacks, requested_w, level_sums) -> dict[str, tuple]:
        """{gpuN: (its mean power W over the level's measured decode spans, its enforced limit W, the OR of its
        clock-event reasons or None)}: each GPU's own energy, as the level's power is the windows' energy."""
        spans = [sp for v in visits for sp in v.spans]
        s0, s1 = engine.merge_intervals(np.array([a for a, _ in spans], np.int64), np.array([b for _, b in spans], np.int64))
        indexes = list(self.prof.gpu.indexes)
        energy = np.zeros(len(indexes))
        known = np.ones(len(indexes), bool)
        for a, b in zip(s0, s1):
            per = self.prof.timeline.energy_between(int(a), int(b)).gpu_energy_j
            for k, e in enumerate(per):
                if e is None:
                    known[k] = False
                else:
                    energy[k] += e
        dur_s = float(np.sum(s1 - s0)) / 1e9 if s0.size else 0.0
        out = {}
        for k, i in enumerate(indexes):
            label = f"gpu{i}"
            enforced = [g.enforced_w for b in readbacks for g in b.gpus if g.index == i and g.enforced_w is not None]
            power = energy[k] / dur_s if known[k] and dur_s > 0 else None
            mine = level_sums.devices.get(label)
            reasons = mine.reasons if mine is not None and mine.reasons_n else None  # None: it cannot report them
            out[label] = (power, float(np.mean(enforced)) if enforced else requested_w, reasons)
        return out

    def windows_table(self):

        return table_from_rows("windows", self.rows)

    def levels_table(self, samples=None):

        windows = self.windows_table()
        if not any(self._counts(r) for r in self.rows):

            return table_from_rows("levels", [])
        table = summarize_levels(windows, self.reference_value, run_id=self.run_id, extra=self.level_extras(samples))
        table = _flag_levels(table, {v.level_value for v in self.visits if v.restarted}, RESTARTED_FLAG)
        table = _flag_levels(table, {v.level_value for v in self.visits if v.restarts and not v.restarted}, AWAY_FLAG)
        return _flag_levels(table, {v.level_value for v in self.visits if v.stop is None}, "interrupted")

    def flush(self) -> None:
        """Rewrite the run's tables (atomically): a crash keeps every finished level.

        A row its column cannot hold is left out (and out of every figure), said in run.json and on
        screen, rather than failing the write and losing the levels already finished."""
        from powerprof.storage.runs import split_storable

        self.rows, bad, err = split_storable("windows", self.rows)
        try:
            if bad:
                self.unstored_rows += len(bad)
                self.ui.note(f"{len(bad)} window row(s) could not be stored and are left out of every figure: {err}")
                self.writer.write_json(unstored_window_rows=self.unstored_rows, unstored_error=err)
            extra = {"server_restarts": self.restarts} if self.restarts else {}
            if self.idle_note:
                extra["idle_baseline_note"] = self.idle_note
            extra.update(idle_gpu_power_w=self.idle_power_w, idle_gpu_power_w_by_gpu=self.idle_power_by_gpu_w,
                         levels_done=[(v.level_value, v.repeat) for v in self.visits if v.stop])
            self.writer.write("windows", self.windows_table(), coming=extra)
            samples = self.timeline.to_table()
            self.writer.write("samples", samples, coming=extra)
            self.writer.write("levels", self.levels_table(samples), coming=extra)
            self.writer.write_json(**extra)
        except OSError as e:
            raise run_write_error(getattr(self.writer, "path", "the run directory"), e) from None


@dataclass(frozen=True)
class TraceLevel:
    """One level of `sweep --trace`: the whole trace replayed at that setting."""

    level_value: float
    n_ok: int
    n_failed: int
    generated_tokens: int
    duration_s: float
    gpu_energy_j: float | None
    energy_method: str
    gpu_j_per_token: float | None
    tok_s: float | None  # every token of the replay over its span: the server's throughput, set mostly by the trace
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None
    tpot_p50_s: float | None
    late_p95_s: float
    foreign_traffic: str | None = None  # others' work ran beside the replay: what showed it (no J/token, no tok/s)
    replayed_again: str | None = None  # others' work ran beside the first replay (what showed it): these figures are the second's
    request_tok_s: float | None = None  # the median request's own decode rate: the level's decode_tok_s, what analyze compares

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class TraceSweep(Sweep):
    """A sweep whose every level replays a whole trace (`sweep --trace`): one `trace` window per
    level (its energy over the replay, every token generated: the traffic mix's J/token) beside a
    request row per replayed request. Levels, settling, idle baseline and the run directory are the
    normal sweep's."""

    def __init__(self, trace, on_level=None, **kw):
        super().__init__(prompts=[], **kw)
        self.trace = list(trace)
        self.on_level = on_level
        self.levels_done: list[TraceLevel] = []
        self._notes: list[str] = []  # why a level's figures are missing or are not the trace's traffic
        self._few: dict[str, int] = {}  # level → requests its p95 figures rest on, where too few

    @property
    def level_notes(self) -> list[str]:
        from powerprof.workload.replay import few_for_p95, trace_notes

        few = []
        if self._few:
            n = min(self._few.values())
            few = [f"{', '.join(self._few)}: " + few_for_p95(n)]
        return trace_notes(self.trace) + self._notes + few

    async def _measure(self, visit: LevelVisit) -> None:
        from powerprof.workload.replay import LATE_NOTE_S, cut_short, few_for_p95, replay_async, summarize

        t_start = time.monotonic()
        self._watch_from_now(visit)
        name = _level_name(visit) + (f" (repeat {visit.repeat + 1})" if self.s.repeats > 1 else "")
        replayed_again = None
        for attempt in range(2):
            # A replay's requests overlap: no moment inside it is free of ours, so the server's books and the GPUs'
            # processes are compared over the whole replay, as one batch (workload/others.py).
            await self._watch_others()
            with self.prof.window("trace") as w:
                recs = await replay_async(self.session, self.server, self.trace, self.params)
            records = [r.record for r in recs]
            self._look_again(min((r.t_send_wall_ns for r in records), default=None), visit)
            visit.elapsed_s = time.monotonic() - t_start
            others = await self._others_beside(records)
            value = None if visit.level_value is None else float(visit.level_value)
            level = Level(self.s.level_kind, value, visit.repeat)
            rows, _ = window_rows(records, self.prof, self.run_id, self.server, level)
            for row in rows:  # the replay numbers its requests from 0 at every level
                row["request_id"] = self._rid + row["request_id"]
            self._rid += len(self.trace)
            row = trace_row(records, w.result, self.run_id, self.server, level)
            self._above_idle(row)
            rows.append(row)
            if others:
                # The replay's energy holds the others' work and its latencies their queueing: nothing of it splits off.
                for r in rows:
                    if r.get("status") == "ok" and not r.get("warmup"):
                        leave_out_foreign(r, others)
                visit.foreign.append(others)
                visit.foreign_windows += 1 if row.get("status") == "ok" else 0
            self.rows.extend(rows)
            self._stop_if_setting_moved(visit, rows, len(visit.spans), w.result.t1_ns)
            if others and attempt == 0:
                # Others' work is often a burst (a colleague's script, a job's step): the same replay once more, as a
                # plain sweep sends a left-out batch's prompts again; bounded at one retry, so others at work
                # throughout cost the level one replay more, not the sweep's end.
                replayed_again = others
                self.ui.note(f"{name}: others' work ran beside its replay ({others}); replaying it once more")
                self.flush()
                continue
            break
        # Judged before the level is told done: a replay left out at its end prints no figure (_judge_level_end).
        await self._judge_level_end(visit)
        if row.get("timing") != "untrusted":  # left out at the level's end: its readings leave the figures too
            visit.spans.append((w.result.t0_ns, w.result.t1_ns))
        visit.n_measured = 1 if self._counts(row) else 0
        visit.stop = "trace-replayed"
        sm = summarize(recs)
        lvl = TraceLevel(
            level_value=visit.level_value, n_ok=sm.ok, n_failed=sm.failed, generated_tokens=sm.generated_tokens,
            duration_s=w.result.duration_s, gpu_energy_j=row["gpu_energy_j"], energy_method=row["energy_method"],
            gpu_j_per_token=row["gpu_j_per_token"],
            tok_s=sm.generated_tokens / w.result.duration_s if w.result.duration_s > 0 and self._counts(row) else None,
            ttft_p50_s=sm.ttft_p50_s, ttft_p95_s=sm.ttft_p95_s, latency_p50_s=sm.latency_p50_s,
            latency_p95_s=sm.latency_p95_s, tpot_p50_s=sm.tpot_p50_s, late_p95_s=sm.late_p95_s,
            foreign_traffic=others, replayed_again=replayed_again, request_tok_s=row.get("decode_tok_s"),
        )
        self.levels_done.append(lvl)
        if (cut := cut_short(recs)) and not any("cut short" in n for n in self._notes):
            self._notes.append(f"{name}: {cut}")
        if few_for_p95(sm.ok) and sm.ok:
            self._few[name] = sm.ok
        if sm.failed and any(server_away(r) for r in records):
            from powerprof.workload.replay import away_record

            self._notes.append(
                f"{name}: {row['error']}; {away_record(recs)['message']}; no J/token for this level "
                "(the replay's energy holds the failed requests' work, not their tokens); sweep --trace does not "
                "ride out a server that goes away: rerun once it stays up")
        elif sm.failed:
            self._notes.append(
                f"{name}: {row['error']}; no J/token for it (the replay's energy holds the failed requests' work, "
                f"its tokens not theirs) and its latencies rest on the {sm.ok} that succeeded; fix: see `error` in "
                "the request rows of windows.parquet (a request longer than the server's context fails at every "
                "level: drop it from the trace; timeouts or HTTP 429/503 only here: the server cannot serve this "
                "traffic at this setting)")
        if sm.late_p95_s > LATE_NOTE_S:
            self._notes.append(
                f"{name}: requests were sent late (p95 {sm.late_p95_s:.2f} s, worst {max(r.late_s for r in recs):.2f} s): "
                "powerprof could not keep the trace's pace, so this level's traffic was not the trace's and its "
                "figures are not comparable with the other levels'; fix: a less busy host, or a smaller --time-scale")
        if self.on_level is not None:
            self.on_level(lvl)

    def _measured(self, row: dict) -> bool:
        return row["window_kind"] == "trace" and not row["warmup"] and row["status"] == "ok"

    @property
    def foreign_notes(self) -> list[str]:
        """Levels whose replay ran beside others' work (flag foreign-traffic): no figure, what was seen, the fix; once,
        what could not be ruled out."""
        if self.others is None:
            return []
        hit = [v for v in self.visits if v.foreign]
        out = []
        if hit:
            def where(v) -> str:
                name = _level_name(v) + (f" (repeat {v.repeat + 1})" if self.s.repeats > 1 else "")
                if v.n_measured:
                    return (f"{name}: its first replay beside them ({v.foreign[0]}), replayed once more without them: "
                            "its figures are the second replay's")
                if len(v.foreign) > 1:
                    return (f"{name}: both replays beside them, first because {v.foreign[0]}: no J/token, no tok/s "
                            "(their latencies are printed, with the others' queueing in them)")
                return (f"{name}: its first replay beside them ({v.foreign[0]}), replayed once more without them, "
                        "which has no figure either (the level's other notes say why)")

            out.append(f"others' work ran beside the replay (flag {FOREIGN_FLAG}): powerprof saw "
                       f"{self.others.saw() or 'it'} not its own. {'; '.join(where(v) for v in hit)}. A replay's "
                       "requests overlap, so its energy and latencies cannot be split into ours and theirs: a replay "
                       "beside others' work is left out and replayed once more; "
                       + (f"fix: {FOREIGN_FIX}; or --repeats N replays each level N times, and the clean repeats keep "
                          "their figures" if any(not v.n_measured for v in hit) else f"to keep it from happening: {FOREIGN_FIX}"))
        return out + self.others.cannot

    def excluded(self):
        """Trace windows left out: their timing is the replay's edges, but their tokens are the server's
        counts, which a server contradicting its own stream leaves unknown (arrival.count_problem)."""
        from powerprof.workload.measure import excluded_windows

        return excluded_windows(self.rows, counted_kind=lambda r: "trace")


# --- wiring: what `powerprof sweep` runs ---------------------------------------------------------


@dataclass
class SweepOutcome:
    run_dir: object
    sweep: Sweep | None
    levels: object | None  # pyarrow Table (levels.parquet)
    plan_lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    in_use: bool = False  # a dry run's GPU is held by a live run: nothing can run until it ends (the dry run fails)


def _kept_note(run_dir, levels_done: list) -> str:
    """What a stopped sweep left: where, how many levels finished, and what can be done with them.

    `levels_done` lists visits ([level, repeat], a grid's with its config and context after them):
    with --repeats a level is visited once per pass, so the levels are the distinct ones, and the
    visits are said beside them when they differ."""
    from powerprof.storage.runs import run_folder_gone

    if (gone := run_folder_gone(run_dir)) is not None:
        return f"stopped: {gone}; nothing of this run was kept (rerun it)"
    n = len(levels_done)
    if n == 0:
        return f"stopped before any level finished: {run_dir} holds nothing to analyse"
    levels = len({(v[0], *v[2:]) for v in levels_done})
    visits = f" ({n} visits)" if n != levels else ""
    return f"stopped: {levels} finished level{'s' if levels > 1 else ''}{visits} kept in {run_dir} (powerprof analyze {run_dir})"


def busy_host_level_notes(levels, profiler, level_kind: str) -> list[str]:
    """Levels whose GPU+CPU J/token counts other processes' CPU energy (flag busy-host), with the fix; or, once,
    that every GPU+CPU figure could, where the server's processes were not found."""
    rows = levels.to_pylist() if levels is not None else []
    unit = {"power_limit": " W", "sm_clock": " MHz"}.get(level_kind, "")

    def name(r):
        what = "the settings as they are" if r["level_value"] is None else f"{r['level_value']:g}{unit}"
        return what + (f" at concurrency {r['concurrency']}" if (r.get("concurrency") or 1) > 1 else "")

    busy = [r for r in rows if BUSY_HOST_FLAG in (r.get("flags") or "").split(",")]
    out = []
    if busy:
        worst = max(busy, key=lambda r: r["other_cpu_pct"])
        out.append(f"{busy_host_text(worst['other_cpu_pct'])} ({name(worst)}; flag {BUSY_HOST_FLAG} on "
                   f"{', '.join(name(r) for r in busy)}); fix: {BUSY_HOST_FIX}")
    own = [r for r in rows if r.get("total_j_per_token") is not None and (r.get("powerprof_cpu_pct") or 0) > BUSY_HOST_PCT]
    if own:
        out.append(f"powerprof itself (its load generator and sensor reads) used up to "
                   f"{max(r['powerprof_cpu_pct'] for r in own):.0f}% of the host's busy CPU time: that is in the GPU+CPU "
                   "J/token too (the measuring tool's overhead, not the server's)")
    with_total = [r for r in rows if r.get("total_j_per_token") is not None]
    if getattr(profiler, "cputime", None) is not None and with_total and all(r.get("other_cpu_pct") is None for r in with_total):
        why = profiler.timeline.server_note or "no CPU-time reading covers the windows"
        out.append(f"{unknown_server_text(why)}; fix: {BUSY_HOST_FIX}")
    return out


def _remove_if_empty(path) -> None:
    try:
        path.rmdir()  # only succeeds when empty
    except OSError:
        pass


def run_sweep(
    rig,
    settings: SweepSettings | None = None,
    *,
    levels_spec: str,
    level_kind: str = "power_limit",
    url: str | None = None,
    launch: str | None = None,
    out_dir=None,
    runs_base="runs",
    prompts=None,
    params=None,
    api: str | None = None,
    interval_s: float = 1.0,
    dry_run: bool = False,
    command_line: str = "",
    ui: UI | None = None,
    launch_timeout_s: float = 300.0,
    runner=None,
    plan_lines: list[str] | None = None,
    trace=None,
    trace_meta: dict | None = None,
    on_level=None,
    allow_unmeasured_server_gpus: bool = False,
    **settings_kw,
) -> SweepOutcome:
    """Sweep on the `rig` (powerprof.rig.Rig: its GPUs, RAPL and server, whatever they are): open
    everything, validate before touching anything, run, and put every GPU back.

    Order matters: levels are parsed against the device's range before the server is started
    or a limit changes, so bad input costs nothing and changes nothing.

    runner: for a configuration sweep (powerprof.grid), a callable taking the opened run's parts
    (keywords: settings, profiler, controller, timeline, writer, run_id, reference_value, ui) and
    returning an object with run(), flush() and levels_table() that launches its own servers.
    level_kind "none": measure at the settings as they are (no controller, no privilege needed).
    trace: replay these TraceRequests at every level instead of prompts (TraceSweep); trace_meta
    (the trace's identity) goes into run.json; on_level(TraceLevel) after each level.
    allow_unmeasured_server_gpus: a server GPU not measured is said in the notes instead of refused
    (workload/placement.judge_placement).
    """


    try:
        rig.check_server(url, launch)
    except ValueError as e:
        raise SweepError(str(e)) from None
    if trace is not None and not trace:
        raise SweepError("the trace has no requests")
    prompts = prompts or builtin_prompts("short")
    params = params or RequestParams()
    notes: list[str] = []
    with ExitStack() as stack:
        src = rig.sources
        if src.nvml is None:
            why = "; ".join(p.message + (f" (fix: {p.fix})" if p.fix else "") for p in src.problems if p.source == "nvml")
            raise SweepError(f"a sweep needs a GPU whose power limit it can set: {why or 'no GPU found'}")
        nvml = src.nvml.nvml
        indexes = src.nvml.indexes
        with gateway(nvml).session():
            devices = read_devices(nvml, indexes)
        if level_kind == "power_limit":
            values = parse_power_levels(levels_spec, devices)
        elif level_kind == "sm_clock":
            values = parse_clock_levels(levels_spec, devices)
        else:
            values = ()
        settings = settings or SweepSettings(level_kind, tuple(float(v) for v in values), **settings_kw)
        if launch or runner is not None or trace is not None:
            # A launched server is our child: one that exits has died (its death_note says so), not restarted.
            # A trace replay records what failed and the level has no figure (TraceSweep).
            settings = replace(settings, server_restart_wait_s=0.0)
        infos = src.nvml.infos
        label = rig.run_label(infos[0].name) if infos else "gpu"
        run_dir = Path(out_dir) if out_dir else default_run_dir(Path(runs_base), label)
        # Refuse an unusable --out before a server is launched or a GPU is locked, and in a dry run too: it
        # validates, and passed an --out the sweep itself then refused (a finished run's folder, root in /tmp).
        from powerprof.paths import path_problem

        if (why := path_problem(run_dir)) is not None:  # it said "[Errno 36] File name too long", from exists()
            raise OutRefused(f"--out {run_dir}: {why}")  # a usage error, exit 2 (it was 1)
        if (why := given_out_problem(run_dir, default=not out_dir)) is not None:
            raise OutRefused(why)
        # A default name taken (another run started in the same second) is no error: the next free one is claimed.
        if out_dir and run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise SweepError(f"run directory {run_dir} already exists and is not empty; choose another --out")
        why = out_dir_refusal(run_dir)
        if why:  # root writes every table, run.json and a launched server's log (by a name known in advance) there
            raise SweepError(why)
        if dry_run:
            spec = levels_spec
            plan = rig.plan(indexes, spec if level_kind == "power_limit" else None, spec if level_kind == "sm_clock" else None)
            lines = (plan.lines() if level_kind != "none" else ["levels: none (the settings as they are)"]) + list(plan_lines or [])
            return SweepOutcome(None, None, None, lines, rig.notes, in_use=plan.in_use)
        try:
            if out_dir:
                run_dir.mkdir(parents=True, exist_ok=True)
            else:
                run_dir = claim_run_dir(run_dir)
        except OSError as e:
            raise SweepError(f"cannot create the run directory {run_dir}: {e.strerror or e}") from None
        stack.callback(_remove_if_empty, run_dir)  # a sweep that fails before writing leaves nothing

        server_info = None
        launched: list = []
        if runner is None:  # a configuration sweep launches a server per configuration
            url = stack.enter_context(rig.server(url, launch, launch_timeout_s=launch_timeout_s, launched=launched))
            server_info = detect(url, api)
            too_long = context_problem(server_info, params.max_tokens, prompts) if trace is None else None
            if too_long:
                raise SweepError(too_long)  # before any limit is set: each request would be refused, or cut short
        notes.extend(rig.notes)
        from powerprof.workload.serverprocs import ServerProcesses

        server_procs = ServerProcesses(url, launched) if url else None
        # Every GPU NVML reports, not only the measured ones: a server GPU left out is refused before any limit is
        # set (its energy in no figure, its limit not stepped); a measured GPU the server does not use is said.
        first = find_placement(nvml, src.gpu_uuids, server_procs)
        cost = cost_words(level_kind)  # a clock sweep steps clocks, not limits
        judge_placement(first, notes, allow=allow_unmeasured_server_gpus, cost=cost)
        # Looked at again after every batch: a small model idle during this look was taken for a helper.
        look = LookUnderLoad(nvml, src.gpu_uuids, server_procs, first, allow=allow_unmeasured_server_gpus,
                             stopped="the sweep stopped at its first level, none of it kept", cost=cost,
                             notes=notes)

        ctl = stack.enter_context(rig.controller(indexes)) if level_kind != "none" else None
        # Whose CPU time the host spent, beside RAPL's whole-package energy: a busy host is flagged (busy-host).
        cputime = rig.cpu_time_collector(url, launched) if src.rapl is not None else None
        profiler = stack.enter_context(
            Profiler(gpu_collector=src.nvml, rapl=src.rapl, extra_collectors=[src.host] if src.host else [], interval_s=interval_s,
                     cputime=cputime)
        )
        for p in src.problems:
            if p.source == "rapl":  # CPU energy missing, or measured with a part left out (no DRAM zone)
                missing = "CPU energy not measured: " if src.rapl is None else ""
                notes.append(f"{missing}{p.message}" + (f" (fix: {p.fix})" if p.fix else ""))
            elif p.source == "nvml" and "MIG" in p.message:  # the figures are the whole GPU's: every output says so
                notes.append(p.message + (f" (fix: {p.fix})" if p.fix else ""))
        timeline = Timeline(gpu_uuids=src.gpu_uuids)
        profiler.sampler.subscribe(timeline)

        run_id = uuid.uuid4().hex[:12]
        default_w = devices[0].default_w if len({d.default_w for d in devices}) == 1 else None
        reference = default_w if level_kind == "power_limit" and default_w in settings.levels else None
        meta = {
            "kind": "sweep",
            "run_id": run_id,
            "started_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "version": __version__,
            "command_line": command_line,
            **rig.meta(),
            "server": server_info.meta() if server_info is not None else None,
            "gpus": [
                {
                    "index": i.index,
                    "uuid": i.uuid,
                    "name": i.name,
                    "driver": i.driver_version,
                    "min_limit_w": i.limit_min_w,
                    "max_limit_w": i.limit_max_w,
                    "default_limit_w": i.limit_default_w,
                }
                for i in infos
            ],
            "original_limits_w": list(ctl.original_limits_w) if ctl is not None else None,
            "stray_lock_check_skipped": ctl.stray_lock_check_skipped if ctl is not None else None,
            "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.__dict__.items()},
            "params": {k: v for k, v in params.__dict__.items() if not k.endswith("_timeout_s")},
            "interval_s": interval_s,
            "notes": notes,
        }
        if trace is not None:
            meta["trace"] = dict(trace_meta or {}, requests=len(trace))
        else:
            meta["prompt_set"] = prompt_set_record(prompts)  # what analyze's pooling check compares
        writer = RunWriter(run_dir, meta)
        parts = dict(settings=settings, profiler=profiler, controller=ctl, timeline=timeline, writer=writer,
                     run_id=run_id, reference_value=reference, ui=ui)
        if runner is not None:
            sweep = runner(**parts)
        elif trace is not None:
            sweep = TraceSweep(trace, on_level, server=server_info, params=params, server_procs=server_procs,
                               placement_look=look, **parts)
        else:
            sweep = Sweep(server=server_info, prompts=prompts, params=params, server_procs=server_procs,
                          placement_look=look, **parts)
        try:
            try:
                try:
                    sweep.run()
                except SweepError as e:
                    died = launched[0].death_note() if launched else ""
                    if died:
                        raise type(e)(f"{e}; {died}") from None
                    raise
            finally:
                # Restore before the last write, so the final samples show the original limit back.
                # If restoring fails the controller keeps its restore file (and retries on close);
                # the finished levels are written either way.
                try:
                    if ctl is not None:
                        ctl.restore()
                finally:
                    sweep.timeline.set_tags()
                    profiler.sampler.sample_now("restored")
                    sweep.flush()
            levels = sweep.levels_table()
        except BaseException as e:
            # Ctrl-C, a signal or an error, wherever it struck: the person must learn where the levels went.
            if ui is not None:
                ui.stopped(_kept_note(run_dir, writer.metadata.get("levels_done") or []))
            if isinstance(e, PlacementStop):
                # The notes known only at the end (a grid's placement notes, the stop itself) were never written on
                # this path; a failed write does not hide the stop.
                try:
                    writer.write_json(notes=notes + list(getattr(sweep, "placement_notes", [])) + [str(e)])
                except Exception:  # noqa: BLE001
                    pass
            raise
    notes.extend(profiler.edge_notes())
    notes.extend(busy_host_level_notes(levels, profiler, settings.level_kind))
    notes.extend(getattr(sweep, "level_notes", []))
    notes.extend(getattr(sweep, "restart_notes", []))
    notes.extend(getattr(sweep, "foreign_notes", []))
    notes.extend(getattr(sweep, "placement_notes", []))  # a grid's: each configuration's server checked as it started
    notes.extend(getattr(sweep, "cut_notes", []))
    if ctl is not None:
        notes.extend(ctl.notes)  # a GPU reset between levels: reopened by its UUID, the next level set on it
    ex = sweep.excluded()
    if ex is not None:
        notes.append(ex.message())
    # run.json was written before the levels ran: the notes known only now (late edge reads, others' work, restarts)
    # were on the end screen alone, and lost with the terminal.
    writer.write_json(notes=notes)
    return SweepOutcome(run_dir, sweep, levels, [], notes)
