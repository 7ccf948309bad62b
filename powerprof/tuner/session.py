"""One `powerprof tune` run on the GPUs the door opened: settings checked, log, metrics, first read, then the loop.

The command (cli.py) installs the early kill switch, opens the Rig and says what these raise; everything between is
here. Two steps, because their failures mean different things: `prepare` refuses before anything is changed
(`TuneUsageError`: exit 2; `TuneRefused`: exit 1), `TuneSession.run` stops with the original limits back (the
controller's errors, a refused --out, an OSError, Ctrl-C and the signals propagate for the command to word).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from prometheus_client import CollectorRegistry

from powerprof import termination
from powerprof.control.levels import LevelError

from .observe import SCRAPE_DEADLINE_S, ObserveError, fetch_metrics, loopback_reason, parse_counters
from .policy import TunerConfig, TunerConfigError
from .runner import KillSwitch, TuneRunner, install_kill_switch
from .setup import (check_bounds, check_out_dir, check_root_folder, gpu_problem, kill_file, load_table, make_config,
                    slo_warnings)


class TuneUsageError(Exception):
    """What the user gave cannot be tuned with (a usage error, exit 2): nothing was changed."""


class TuneRefused(Exception):
    """The GPUs cannot be tuned as they are (exit 1): nothing was changed."""


def read_settings(metrics_url: str, config_path: Path | None, *, levels: str | None, reference: str | None,
                  tpot_p95_ms: float | None, ttft_p95_ms: float | None, dry_run: bool) -> dict:
    """The [tuner] table the run uses: the file's, with the command line's settings over it. Raises TuneUsageError
    for a --daemon-metrics that is not loopback or a file that cannot be trusted or read."""
    why = loopback_reason(metrics_url)
    if why:
        raise TuneUsageError(why)
    try:
        table = load_table(config_path)
    except TunerConfigError as e:
        raise TuneUsageError(str(e)) from None
    overrides = {k: v for k, v in (("tpot_p95_ms", tpot_p95_ms), ("ttft_p95_ms", ttft_p95_ms)) if v is not None}
    if dry_run:
        overrides["dry_run"] = True
    table = {**table, **overrides}
    if levels is not None:
        table["levels"] = levels
    if reference is not None:
        table["reference"] = reference
    return table


def prepare(rig, table: dict, *, metrics_url: str, gpus: list, out_dir: Path, default_out: bool,
            metrics_port: int | None, resume: bool, early_kill: KillSwitch,
            say: Callable[[str], None]) -> "TuneSession":
    """Everything the user gave, checked before a controller opens (nothing changed, no restart loop under systemd),
    then the tuner's /metrics server and its log on stderr. `say` writes one line on stderr."""
    if (why := gpu_problem(rig.nvml)) is not None:
        raise TuneRefused(why)
    if any(isinstance(g, str) for g in gpus):  # UUIDs (a MIG instance stands for its GPU): the NVML indexes
        try:
            src = rig.sources
        except ValueError as e:
            raise TuneUsageError(str(e)) from None
        if src.nvml is None:
            raise TuneUsageError(f"--gpus {','.join(map(str, gpus))}: no GPU could be opened")
        for p in src.problems:
            if "MIG" in p.message:
                say(f"note: {p.message}")
        gpus = list(src.nvml.indexes)
    try:
        def plan_levels(knob, spec):
            p = rig.plan(gpus, power_levels=spec) if knob == "power" else rig.plan(gpus, clock_levels=spec)
            return list(p.power_levels_w) if knob == "power" else list(p.clock_levels_mhz)

        cfg = make_config(table, plan_levels)
        check_bounds(cfg)
        for w in slo_warnings(cfg):
            say(f"warning: {w}")
        check_out_dir(out_dir, parents=default_out)
        if not cfg.dry_run:  # the kill switch's file, beside the controller's locks and restore files
            check_root_folder(kill_file().parent, "state folder")
            early_kill.arm(kill_file())
        uuids = [d.uuid for d in rig.plan(gpus).devices]
    except (TunerConfigError, LevelError) as e:
        raise TuneUsageError(str(e)) from None
    registry = CollectorRegistry()
    if metrics_port is not None:
        from prometheus_client import start_http_server

        try:
            start_http_server(metrics_port, addr="127.0.0.1", registry=registry)
        except OSError as e:
            raise TuneUsageError(f"--metrics-port {metrics_port}: {e.strerror or e}") from None

    # Every decision (explore, back-off, kill, stop) as one line on stderr: root's journal under systemd, beside the
    # dataset and /metrics. Without a handler only warnings reached stderr, through logging's last resort.
    from powerprof.daemon.service import log_format

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(log_format()))
    tune_log = logging.getLogger("powerprof.tune")
    tune_log.addHandler(handler)
    tune_log.setLevel(logging.INFO)
    tune_log.propagate = False
    return TuneSession(rig, cfg, metrics_url=metrics_url, gpus=gpus, gpu_uuids=uuids, out_dir=out_dir,
                       registry=registry, resume=resume, early_kill=early_kill, say=say)


class TuneSession:
    """A checked tuner, ready to run: `run` holds the GPUs until --duration or a signal. `caught`: the signal that
    stopped a dry run (the command exits 128 + it, as the controller does when it holds the GPUs)."""

    def __init__(self, rig, cfg: TunerConfig, *, metrics_url: str, gpus: list, gpu_uuids: list, out_dir: Path,
                 registry: CollectorRegistry, resume: bool, early_kill: KillSwitch, say: Callable[[str], None]):
        self.rig, self.cfg, self.metrics_url, self.gpus, self.gpu_uuids = rig, cfg, metrics_url, gpus, gpu_uuids
        self.out_dir, self.registry, self.resume, self.early_kill, self.say = out_dir, registry, resume, early_kill, say
        self.stop = threading.Event()
        self.caught: list[int] = []

    def _read(self):
        return parse_counters(fetch_metrics(self.metrics_url), time.monotonic())

    def _run_tuner(self, ctl, duration_s: float | None) -> None:
        cfg, gpus, say = self.cfg, self.gpus, self.say
        runner = TuneRunner(cfg, self._read, ctl=ctl, gpus=gpus, out_dir=self.out_dir, registry=self.registry,
                            gpu_uuids=self.gpu_uuids, kill_path=None if cfg.dry_run else kill_file(),
                            clear_kill=self.resume, kill_requested=self.early_kill.requested)
        install_kill_switch(runner)
        for note in self.rig.notes:
            say(f"NOTE: {note}")
        say(f"tuning GPUs {','.join(map(str, gpus))}: levels {', '.join(f'{x:g}' for x in cfg.levels)} "
            f"{cfg.unit}, reference {cfg.reference:g}{' (dry run: recommendations only)' if cfg.dry_run else ''}")
        if cfg.reference != cfg.levels[-1]:
            say(f"WARNING: the reference {cfg.reference:g} {cfg.unit} is not the highest level: back-offs, "
                "faults and the kill switch go to it")
        # One read now: a wrong --daemon-metrics said nothing until the first tick (10 s), and then only in
        # the dataset. Not an error: under systemd the daemon may still be starting.
        # In a thread, as the runner reads: headers dripped slowly could hold a read past its deadline.
        probe: list = []

        def read_once():
            try:
                self._read()
            except ObserveError as e:
                probe.append(e)

        reader = threading.Thread(target=read_once, daemon=True, name="tune-first-read")
        reader.start()
        reader.join(SCRAPE_DEADLINE_S + 1)
        if reader.is_alive():
            probe.append(ObserveError(f"{self.metrics_url} did not answer within {SCRAPE_DEADLINE_S + 1:g} s"))
        if probe:
            runner.say_read(probe[0])
        runner.run(self.stop, duration_s)

    def run(self, duration_s: float | None) -> None:
        """Tune until `duration_s` (None: until a signal). The controller puts the original limits back on every exit
        before its error, Ctrl-C or signal reaches the caller."""
        if self.cfg.dry_run:
            # Nothing will be set: no controller, no lock, no permission needed. A signal stops the run and
            # exits 128+signal, as the controller does when it holds the GPUs.
            def on_signal(signum, _frame):
                self.caught.append(signum)
                # Not stop.set() here: the main thread may hold the Event's lock inside stop.wait()
                # when the signal lands (the lock is not reentrant: a deadlock). A thread waits for it.
                threading.Thread(target=self.stop.set, daemon=True).start()

            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) + termination.EXTRA_END_SIGNALS:
                signal.signal(sig, on_signal)
            self._run_tuner(None, duration_s)
        else:
            with self.rig.controller(self.gpus) as ctl:
                self._run_tuner(ctl, duration_s)
            if back := self.rig.restored_line(clocks=self.cfg.knob != "power"):
                self.say(back)  # a normal stop (--duration) said nothing of the GPUs
