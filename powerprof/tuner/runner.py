"""The live tuning loop: read the daemon every tick, ask the policy, set the level through the controller, record why.

Safety (docs/tuner.md): levels change only through the LimitController the door gives
(restore file before the first change, the original limit back on every exit, `powerprof
restore` after kill -9); SIGUSR1 pins the reference level, persisted in a kill file until `tune
--resume`; figures that stop coming (daemon down, a scrape failing or hanging, counters going
backwards, the daemon reading another limit or other GPUs) send the GPUs to the reference level
after `stale_s`, timed by the loop, never by the read; dry-run changes nothing and only reports
what the guard would do at the limit the GPUs actually have.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from powerprof.control.gpulock import make_dirs
from powerprof.errtext import error_text, one_line
from powerprof.storage.runs import atomic_write_table
from powerprof.storage.schema import TUNER_DECISIONS, rows_to_table

from .observe import DaemonCounters, ObserveError, energy_moved, serving_change, window_between
from .policy import Decision, Tuner, TunerConfig, Window, merge, slo_ratio, unfinished_threat
from .setup import day_folder_reason

LEVEL_TOLERANCE_W = 1.0  # the daemon's read-back of a limit the controller set (NVML rounds to its own step)

log = logging.getLogger("powerprof.tune")


def persist_kill(path: Path) -> None:
    """Write the kill switch's file (a failure is logged: the pin then lasts as long as the process)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Never through a symlink: root would truncate whatever file it names.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(f"SIGUSR1 at {_dt.datetime.now(_dt.timezone.utc).isoformat()}\n")
    except OSError as e:
        log.error("cannot persist the kill switch in %s: %s (held until the process ends)", path, e)


class KillSwitch:
    """SIGUSR1 from the first line of `tune` on, before the loop's own handler: one that lands while the tuner starts
    is kept (the loop starts killed) and, once `arm`ed with the kill file, persisted at once. Armed, it also persists
    when the controller's handler (which holds SIGUSR1 from the moment it opens until the loop's handler replaces
    it) calls it on the way to its exit 138: a restart then starts killed instead of tuning."""

    def __init__(self):
        self.requested = threading.Event()
        self.path: Path | None = None

    def __call__(self, *_):
        self.requested.set()
        if self.path is not None:
            persist_kill(self.path)

    def arm(self, path: Path) -> None:
        self.path = Path(path)
        if self.requested.is_set():
            persist_kill(self.path)

    def install(self) -> None:
        """SIGUSR1 is this switch's from now on. One that powerprof.entry's recorder caught while the CLI was being
        imported is taken on (the handler replaced says so in `caught`): it is a kill like any other."""
        prev = signal.signal(signal.SIGUSR1, self)
        if getattr(prev, "caught", 0):
            self()


class OutDirError(OSError):
    """The decisions folder cannot be trusted or written now: the tuner ends (the controller restores the limits)."""


class DecisionLog:
    """Rows of TUNER_DECISIONS, written as one small Parquet file per flush under `out_dir` (None: kept in memory)."""

    def __init__(self, out_dir: Path | None, gpus: list[int], knob: str, euid: int | None = None,
                 gpu_uuids: list[str] | None = None):
        """euid: whose rules the day folders are checked by (None: this process's; tests give 0 for root's).
        gpu_uuids: the same GPUs' UUIDs (None where not known): indexes alone are ambiguous once a node renumbers."""
        self.euid = euid
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.gpus = ",".join(str(g) for g in gpus)
        self.gpu_uuids = ",".join(sorted(gpu_uuids)) if gpu_uuids else None
        self.knob = knob
        self.rows: deque[dict] = deque(maxlen=1000)  # the latest, in memory; all of them in the dataset
        self._unflushed: list[dict] = []
        self.host = socket.gethostname()
        # The key of each row (rowkeys.py): a copy of the folder among export's sources is written once.
        self.tuner_id = uuid.uuid4().hex[:12]
        self.seq = 0
        self.refused: str | None = None  # why the decisions folder was refused: said once, then the tuner ends

    def add(self, d: Decision, t0_s: float, applied: bool) -> None:
        row = {"time_utc": time.time_ns(), "t_mono_s": d.t_s - t0_s, "action": d.action, "knob": self.knob,
               "from_level": d.from_level, "to_level": d.to_level, "applied": applied, "reason": d.reason,
               "regime": d.regime, "j_per_token": d.j_per_token, "slo_ratio": d.slo_ratio, "gpus": self.gpus,
               "gpu_uuids": self.gpu_uuids,
               "tuner_id": self.tuner_id, "seq": self.seq}
        self.seq += 1
        self.rows.append(row)
        self._unflushed.append(row)
        # A stop is the controller's to carry out (its reason says what comes back): "recommended" would misread it.
        how = "" if d.action == "stop" else " (applied)" if applied else " (recommended)"
        log.info("%s %g→%g %s%s", d.action, d.from_level, d.to_level, d.reason, how)

    def flush(self) -> None:
        if self.out_dir is None or not self._unflushed:
            return
        if self.refused:  # the stop row on the way out: refused as the row before it, and said already
            raise OutDirError(self.refused)
        day = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
        day_dir = self.out_dir / f"date={day}"
        # Checked before it is made or written, and again once made or found: checked each flush, as a new day
        # brings a new folder that may have been planted ahead of it.
        why = day_folder_reason(day_dir, self.euid)
        if not why:
            try:
                make_dirs(day_dir, 0o755)  # whatever the umask: never group- or other-writable
            except OSError as e:
                why = f"cannot make it ({e.strerror or e})"
            why = why or day_folder_reason(day_dir, self.euid)
        if why:
            msg = (f"--out {self.out_dir}: not writing the decisions into {day_dir}: {why} (another user could make root "
                   "write any file through it); remove it, or give root a folder of its own (chown root:, chmod go-w)")
            log.error("%s", msg)
            self.refused = msg
            raise OutDirError(msg)
        part = day_dir / f"part-{time.time_ns()}.parquet"
        try:
            atomic_write_table(part, rows_to_table(TUNER_DECISIONS, self._unflushed, fill={"host": self.host}))
        except OutDirError:
            raise
        except OSError as e:
            # A full disk (ENOSPC), a read-only or gone folder: a traceback and exit 1 before, which systemd restarted
            # every 10 s, each start moving the level again. Rows are written before the move they record, so the
            # tuner stops here with no move unrecorded, and exit 2 is not retried (RestartPreventExitStatus=2).
            msg = (f"--out {self.out_dir}: cannot write the tuner's decisions into {day_dir} ({e.strerror or error_text(e)}); the "
                   "tuner stops (it never moves a level without its row); fix: free space there, or give another --out")
            log.error("%s", msg)
            raise OutDirError(msg) from None
        self._unflushed = []


class TunerMetrics:
    """The tuner's own /metrics: level, reference, state, decisions by action, dry-run, staleness."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.level = Gauge("powerprof_tuner_level", "Level the tuner holds (W for power, MHz for clock); absent in dry-run",
                           ["knob"], registry=r)
        self.observed = Gauge("powerprof_tuner_observed_level", "The power limit the daemon reads on the tuned GPUs (W)",
                              ["knob"], registry=r)
        self.reference = Gauge("powerprof_tuner_reference_level", "The reference level", ["knob"], registry=r)
        self.decisions = Counter("powerprof_tuner_decisions", "Tuner decisions by action", ["action"], registry=r)
        self.dry_run = Gauge("powerprof_tuner_dry_run", "1 when the tuner only recommends", registry=r)
        self.stale = Gauge("powerprof_tuner_stale", "1 while the daemon's figures are missing or untrusted", registry=r)
        self.killed = Gauge("powerprof_tuner_killed", "1 after the kill switch: the reference is held", registry=r)
        self.explore_s = Gauge("powerprof_tuner_explore_seconds", "Time spent on trial levels", registry=r)
        self.sees_unfinished = Gauge("powerprof_tuner_sees_unfinished", "1 when the daemon gives the ages of requests "
                                     "not finished (the guard sees a stall), 0 when it is too old to", registry=r)


class TuneRunner:
    """One tuning session over an open controller (or None in dry-run). `run()` returns when `stop` is set."""

    def __init__(self, cfg: TunerConfig, read: Callable[[], DaemonCounters], ctl=None, gpus: list[int] | None = None,
                 out_dir: Path | None = None, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic, gpu_uuids: list[str] | None = None,
                 kill_path: Path | None = None, clear_kill: bool = False, kill_requested: threading.Event | None = None,
                 euid: int | None = None):
        """gpu_uuids: the tuned GPUs; the daemon must measure exactly these (None skips the check: tests of the
        policy plumbing only). kill_path: the persisted kill switch (None: the kill lasts as long as the process);
        clear_kill: `tune --resume`, remove it first. kill_requested: a KillSwitch's event (SIGUSR1 caught before
        this runner existed). euid: whose rules `out_dir`'s day folders are checked by (None: this process's).
        A day folder refused ends run() with OutDirError, the row not written."""
        if ctl is None and not cfg.dry_run:
            raise ValueError("a controller is needed unless dry_run")
        self.cfg = cfg
        self.read = read
        self.ctl = ctl
        self.clock = clock
        self.t0_s = clock()
        self.tuner = Tuner(cfg, self.t0_s)
        self.log = DecisionLog(out_dir, gpus or [], cfg.knob, euid=euid, gpu_uuids=gpu_uuids)
        self.metrics = TunerMetrics(registry)
        self.metrics.dry_run.set(1 if cfg.dry_run else 0)
        self.metrics.reference.labels(cfg.knob).set(cfg.reference)
        self.applied: float | None = None
        self.gpu_uuids = sorted(gpu_uuids) if gpu_uuids is not None else None
        self.kill_path = Path(kill_path) if kill_path is not None else None
        self.clear_kill = clear_kill
        self.kill_requested = kill_requested if kill_requested is not None else threading.Event()
        self._last: DaemonCounters | None = None
        self._last_good_s = self.t0_s
        self._last_error = "no scrape yet"
        self._said_read_error: str | None = None  # the read failure last put on stderr; None while reads work
        self._ever_read = False  # a read of the daemon gave figures once: its stop row says so where none ever did
        self._dry: deque[Window] = deque()  # dry-run: the last guard_s at the GPUs' actual level
        self._dry_said_s = -float("inf")
        self._basis_said = ""  # serving_change's why for the latest window straddling a change of which GPUs serve
        self._progress_said_s = self.t0_s  # a live run says what it waits for once a window_s without a decision
        self._said_blind = False
        self._level_since_s: float | None = None  # when the level on the GPUs was set (this tuner's clock)
        self._said_unaccounted = False

    def on_sigusr1(self, *_):
        self.kill_requested.set()

    def _apply(self, level: float) -> None:
        if self.cfg.dry_run or level == self.applied:
            return
        if self.cfg.knob == "power":
            self.ctl.set_power_limit_w(level)
        else:
            self.ctl.lock_sm_clock_mhz(int(level))
        self.applied = level
        self._level_since_s = self.clock()  # the daemon's energy from before this is another level's

    def _record(self, ds: list[Decision]) -> None:
        for d in ds:
            self.log.add(d, self.t0_s, applied=not self.cfg.dry_run and d.action != "stop")
            self.metrics.decisions.labels(d.action).inc()
        if ds:
            self.log.flush()
            self._progress_said_s = self.clock()

    def _fmt(self, v: float) -> str:
        return f"{v:g} {self.cfg.unit}"

    def _show_level(self) -> None:
        if not self.cfg.dry_run:  # in dry-run nothing is held: the gauge would claim a level that is not on the GPU
            self.metrics.level.labels(self.cfg.knob).set(self.tuner.level)

    def start(self) -> None:
        """The reference level first: the tuner starts from the known-safe setting."""
        cfg = self.cfg
        why = "tuner started at the reference level"
        if cfg.dry_run:
            why = "dry run started: nothing is set; each window is judged at the limit the GPUs have"
        if cfg.reference != cfg.levels[-1]:
            why += (f"; WARNING: the reference {self._fmt(cfg.reference)} is not the highest level "
                    f"({self._fmt(cfg.levels[-1])}): back-offs, faults and the kill switch go to it")
        skipped = self.ctl.stray_lock_check_skipped if self.ctl is not None else None
        if skipped:
            # stderr alone scrolls away under systemd; the dataset is what an operator reads back later.
            why += (f"; WARNING: the check for a second root controller whose lock file was taken out of the lock "
                    f"folder was {skipped}: don't remove or move the lock folder while a controller runs")
        d = self.tuner.note(self.clock(), "start", why)
        if not cfg.dry_run and self.ctl is not None and cfg.knob == "power" and self.ctl.original_limits_w:
            # From where the GPUs were, as the stop row goes back there: "start 250→250" hid a move from 300 W.
            d = self.tuner.decisions[-1] = dataclasses.replace(d, from_level=self.ctl.original_limits_w[0])
        self._record([d])  # each row before the move it records: a row that cannot be written stops the tuner first
        self._apply(self.tuner.level)
        self._show_level()
        if self.kill_path is not None and self.clear_kill and self.kill_path.exists():
            self.kill_path.unlink()
            self._record([self.tuner.note(self.clock(), "resume", f"kill switch cleared by --resume ({self.kill_path})")])
        if self.kill_path is not None and self.kill_path.exists():
            self._kill(f"kill switch persisted in {self.kill_path} (clear it with `powerprof tune --resume`)")

    def _kill(self, why: str) -> None:
        d = self.tuner.kill(self.clock(), why)
        self.metrics.killed.set(1)
        self._record([d])  # unwritable: OutDirError, and the controller puts back the originals (safer still)
        self._apply(self.tuner.level)
        self._show_level()

    def check_kill(self) -> None:
        if self.kill_requested.is_set() and self.tuner.state != "killed":
            if self.kill_path is not None and not self.cfg.dry_run:
                persist_kill(self.kill_path)  # first: a restart (systemd, Requires=) must not silently clear the pin
            self._kill("kill switch (SIGUSR1)")

    def check_stale(self, now: float) -> None:
        """Back to the reference when no trustworthy window came for stale_s: timed here, never by a read."""
        if now - self._last_good_s >= self.cfg.stale_s:
            d = self.tuner.stale(now, f"no trustworthy figures for {now - self._last_good_s:.0f} s ({self._last_error})")
            self.metrics.stale.set(1)
            if d is not None:
                self._record([d])
                self._apply(self.tuner.level)
                self._show_level()

    def _actual_level(self, c: DaemonCounters) -> float | None:
        """The limit the daemon reads on the tuned GPUs (ObserveError when it measures other GPUs or they differ);
        None for the clock knob, whose lock the daemon does not expose."""
        if self.gpu_uuids is not None and sorted(c.gpu_limits_w) != self.gpu_uuids:
            unread = sorted(set(self.gpu_uuids) - set(c.gpu_limits_w))
            if set(c.gpu_limits_w) <= set(self.gpu_uuids) and set(unread) <= c.gpu_unknown_s.keys():
                # The daemon samples those GPUs (each has its unknown-seconds series) and reads no limit on them now:
                # lost, or reads failing. Said as that, not as a daemon measuring other GPUs.
                raise ObserveError(f"the daemon reads no power limit on GPU {', '.join(one_line(u, 80) for u in unread[:8])}"
                                   " now (lost, or its reads failing: powerprof_gpu_up, the daemon's log): the level "
                                   "it runs at cannot be told, so no window is judged until it reads again; to tune "
                                   "without it, restart the daemon with daemon.gpus leaving it out and the tuner with "
                                   "--gpus leaving it out")
            seen = sorted(c.gpu_limits_w)
            named = ", ".join(one_line(u, 80) for u in seen[:8]) + (f" and {len(seen) - 8} more" if len(seen) > 8 else "")
            raise ObserveError(f"the daemon measures GPUs {named or 'none'}, the tuner tunes "
                               f"{', '.join(self.gpu_uuids)}: its energy is not these GPUs'")
        if self.cfg.knob != "power" or self.gpu_uuids is None:
            return None
        limits = [c.gpu_limits_w[u] for u in self.gpu_uuids]
        if max(limits) - min(limits) > LEVEL_TOLERANCE_W:
            raise ObserveError(f"the tuned GPUs have different limits ({', '.join(f'{x:g}' for x in limits)} W)")
        return limits[0]

    def ingest(self, now: float, got: DaemonCounters | ObserveError) -> None:
        """One scrape's result (its counters, or why there are none) at `now`, when the read started."""
        ds: list[Decision] = []
        self.say_read(got)
        try:
            if isinstance(got, ObserveError):
                raise got
            self._ever_read = True
            c = dataclasses.replace(got, t_s=now)
            self._check_sight(c)
            last, self._last = self._last, c
            actual = self._actual_level(c)
            if actual is not None:
                self.metrics.observed.labels(self.cfg.knob).set(actual)
            if last is not None:
                if c.upstream_failures > last.upstream_failures:
                    raise ObserveError(f"the inference server is failing ({c.upstream_failures - last.upstream_failures:.0f} "
                                       "requests not delivered)")
                if not energy_moved(last, c):
                    raise ObserveError("neither the daemon's GPU energy nor its GPUs' unread time has moved (its sampling "
                                       "stalled?)")
                before = self._actual_level(last)
                level = self.tuner.level
                if self.cfg.dry_run:
                    level = actual if actual is not None else self.tuner.reference
                if actual is not None and (abs(before - actual) > LEVEL_TOLERANCE_W or abs(actual - level) > LEVEL_TOLERANCE_W):
                    # A window is judged only at the level that was on the GPUs all through it.
                    raise ObserveError(f"the daemon reads {before:g} → {actual:g} W over this window, not the "
                                       f"{level:g} W intended: not judged")
                w = window_between(last, c, level)
                if self._energy_straddles(last):
                    w = dataclasses.replace(w, energy_straddles=True)
                if (basis := serving_change(last, c)) is not None:
                    # Its energy is on neither side's basis: out of the energy verdicts (its latency still guards),
                    # and levels judged before are no yardstick for those after (Tuner.energy_basis_changed).
                    w = dataclasses.replace(w, energy_straddles=True)
                    self._basis_said = basis
                    if not self.cfg.dry_run:
                        ds.extend(self.tuner.energy_basis_changed(now, basis))
                if self.cfg.dry_run:
                    if self.tuner.state == "stale":
                        ds.append(self.tuner.resume(now))
                    ds.extend(self._dry_verdict(w))
                else:
                    ds.extend(self.tuner.observe(w))
                self._last_good_s = now
                self.metrics.stale.set(0)
        except ObserveError as e:
            self._last_error = one_line(str(e))
        # Recorded first: a move applied and then not written (a full --out) left the GPU at a level no row named, and
        # the stop row unwritten too.
        self._record(ds)
        self._apply(self.tuner.level)
        self._say_progress(now)
        self._show_level()
        self.metrics.explore_s.set(self.tuner.explore_s)
        self.check_stale(now)

    def _say_progress(self, now: float) -> None:
        """Between decisions, minutes apart, a run says once a window what it waits for: a live one its level's next
        judgement, a dry run its next verdict (60 s of a dry run on the defaults said nothing past its start)."""
        if now - self._progress_said_s < self.cfg.window_s:
            return
        self._progress_said_s = now
        if not self.cfg.dry_run:
            log.info("%s", self.tuner.progress(now))
            return
        cfg = self.cfg
        g = merge(list(self._dry)) if self._dry else None
        log.info("dry run: the next verdict has %.0f s of traffic (%.0f s needed) and %d finished requests (%d needed)",
                 g.duration_s if g else 0.0, cfg.guard_s / 2, g.requests if g else 0, cfg.guard_min_requests)

    def _energy_straddles(self, last: DaemonCounters) -> bool:
        """Whether the energy of the window from `last` on was (partly) spent before the level was set: the daemon's
        energy counters come from its closed intervals, `accounts_behind_s` behind its tokens and limit gauge."""
        if self.cfg.dry_run or self._level_since_s is None:
            return False  # dry-run judges the level the GPUs have, set when and by whom the tuner cannot know
        if last.accounts_behind_s is None:
            if not self._said_unaccounted:
                self._said_unaccounted = True
                log.warning("the daemon does not say how far its energy accounts are behind (older than this tuner): "
                            "only the first window after each move is left out of the energy verdicts, and one whose "
                            "joules were spent longer before it is judged at the new level; upgrade the daemon")
            return False
        return last.t_s - last.accounts_behind_s < self._level_since_s

    def _check_sight(self, c: DaemonCounters) -> None:
        """Say once when the daemon gives no ages of unfinished requests (older than the tuner): tuning goes on, its
        guard seeing only requests that have finished, as before those gauges existed."""
        blind = c.oldest_awaiting_s is None or c.longest_silence_s is None
        self.metrics.sees_unfinished.set(0 if blind else 1)
        if blind and not self._said_blind:
            log.warning("the daemon does not give the ages of requests not finished (older than this tuner): the guard "
                        "cannot see a stalled server, only requests that finish late; upgrade the daemon")
        self._said_blind = blind

    def say_read(self, got: DaemonCounters | ObserveError) -> None:
        """A failed read of the daemon on stderr when it starts or changes, and when reads work again: a wrong
        --daemon-metrics said nothing on the terminal, only a stale row in the dataset after stale_s."""
        if isinstance(got, ObserveError):
            msg = one_line(str(got))
            if msg != self._said_read_error:
                then = "" if self.cfg.dry_run else (f"; after {self.cfg.stale_s:g} s without figures it holds the "
                                                    f"reference {self._fmt(self.cfg.reference)}")
                log.warning("no figures from the daemon: %s (trying again every %g s%s)", msg, self.cfg.tick_s, then)
                self._said_read_error = msg
        elif self._said_read_error is not None:
            log.warning("the daemon's figures can be read again")
            self._said_read_error = None

    def _dry_verdict(self, w: Window) -> list[Decision]:
        """Dry-run: what the guard would do at the level the GPUs have, once per window_s; no exploration (a trial
        that is never applied measures nothing)."""
        cfg = self.cfg
        if self._dry and abs(self._dry[-1].level - w.level) > LEVEL_TOLERANCE_W:
            # The limit was moved (by the operator: a dry run sets nothing): the stretch starts again at the new one,
            # or its verdict, labelled the new limit, pooled the old one's J/token and latency (1.15 for 1.0 and 1.3).
            self._dry.clear()
        self._dry.append(w)
        while self._dry and self._dry[0].t_end_s <= w.t_end_s - cfg.guard_s:
            self._dry.popleft()
        g = merge(list(self._dry))
        at = self._fmt(w.level)
        stall = unfinished_threat(w, cfg) if w.level != cfg.reference else None
        if stall is not None and w.t_end_s - self._dry_said_s >= cfg.window_s:
            self._dry_said_s = w.t_end_s
            return [Decision(w.t_end_s, "backoff", w.level, cfg.reference, f"dry run at the GPUs' {at}: {stall[0]}; the "
                             f"guard would go back to the reference {self._fmt(cfg.reference)}", "unknown", None, None)]
        if w.t_end_s - self._dry_said_s < cfg.window_s or g.duration_s < cfg.guard_s / 2 or g.requests < cfg.guard_min_requests:
            return []
        self._dry_said_s = w.t_end_s
        ratio = slo_ratio(g, cfg)
        # The J/token only over the windows after the latest change of which GPUs serve (one straddling it marked):
        # pooled across it, it read a figure neither basis had (1.25 between 1.75 and 1.0). Latency: the whole stretch.
        cut = max((k for k, x in enumerate(self._dry) if x.energy_straddles), default=-1)
        same = list(self._dry)[cut + 1:]
        e = merge(same) if same else None
        jpt = e.energy_j / e.tokens if e is not None and e.tokens > 0 else None
        cut_why = ""
        if cut >= 0:
            over = f"J/token over the last {e.duration_s:.0f} s alone" if jpt is not None else "no J/token yet"
            cut_why = f"; {over}, on one energy basis: {self._basis_said}"
        if ratio is not None and ratio > cfg.guard_ratio and w.level != cfg.reference:
            action, to, then = "backoff", cfg.reference, f"the guard would go back to the reference {self._fmt(cfg.reference)}"
        else:
            action, to, then = "hold", w.level, "the guard would hold"
        why = (f"dry run at the GPUs' {at}: p95 at {ratio:.0%} of the SLO over the last {g.duration_s:.0f} s; {then}"
               if ratio is not None else f"dry run at the GPUs' {at}: no latency in the last {g.duration_s:.0f} s") + cut_why
        return [Decision(w.t_end_s, action, w.level, to, why, "unknown", jpt, ratio)]

    def tick(self) -> None:
        """Read once, in this thread (tests drive it with a virtual clock); run() reads in a worker instead."""
        self.check_kill()
        now = self.clock()
        try:
            got = self.read()
        except ObserveError as e:
            got = e
        self.ingest(now, got)

    def stop_row(self) -> None:
        """The last row: what the GPUs go back to as the tuner ends (the controller restores the originals)."""
        if self.cfg.dry_run or self.ctl is None:
            to, why = self.tuner.level, "dry run stopped: nothing was set"
        else:
            orig = self.ctl.original_limits_w if self.cfg.knob == "power" else ()
            to = orig[0] if orig else self.tuner.level
            why = ("tuner stopped: the controller puts back the original limits "
                   f"({', '.join(f'{x:g} W' for x in orig)}) and releases clock locks")
        if not self._ever_read:
            # A wrong --daemon-metrics ran its --duration out and exited 0 with no word at the end ("no recommendation").
            why += "; no figures were ever read from the daemon (why: the warning at its first read): nothing was judged"
            log.warning("stopped with no figures ever read from the daemon: nothing was judged; check --daemon-metrics")
        self._record([Decision(self.clock(), "stop", self.tuner.level, to, why, self.tuner.regime_name)])

    def run(self, stop: threading.Event, duration_s: float | None = None) -> None:
        """Tick until `stop` (or duration_s). Each read runs in a worker thread: a daemon that hangs or drips its answer
        delays no kill switch and no stale fallback, which this loop times itself."""
        self.start()
        end = None if duration_s is None else self.t0_s + duration_s
        next_tick = self.t0_s + self.cfg.tick_s
        box: dict = {}
        worker: threading.Thread | None = None
        try:
            while not stop.is_set():
                now = self.clock()
                if end is not None and now >= end:
                    break
                self.check_kill()  # the kill switch acts within a fraction of a second, not at the next tick
                if worker is not None and not worker.is_alive():
                    worker = None
                    self.ingest(box["t"], box["got"])
                if worker is None and now >= next_tick:
                    box = {"t": now}
                    worker = threading.Thread(target=self._read_into, args=(box,), daemon=True, name="tune-scrape")
                    worker.start()
                    next_tick = max(next_tick + self.cfg.tick_s, now)
                self.check_stale(now)
                stop.wait(min(0.2, max(0.01, next_tick - now)))
        finally:
            try:
                self.stop_row()
            finally:
                self.log.flush()

    def _read_into(self, box: dict) -> None:
        try:
            box["got"] = self.read()
        except ObserveError as e:
            box["got"] = e
        except Exception as e:  # noqa: BLE001 (a bug in reading is no figures, not a dead loop)
            box["got"] = ObserveError(f"reading the daemon failed: {error_text(e)}")


def install_kill_switch(runner: TuneRunner) -> None:
    """SIGUSR1 → back to the reference and hold (main thread only, where Python delivers signals)."""
    signal.signal(signal.SIGUSR1, runner.on_sigusr1)
