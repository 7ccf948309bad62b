"""The one door: the only module that decides whether the GPU, the CPU energy source and the server are real, simulated, given or launched.

Every command opens one `Rig` and hands it down; no layer below imports `powerprof.sim` or takes
a `simulate` parameter (Kepler chooses its fake meter with one key in one place; so do we).

    with Rig(sim_profile="seed-16g") as rig:          # or Rig() for this machine's hardware
        src = rig.sources                              # NVML, RAPL and host collectors
        with rig.server(url, launch) as server_url:    # given, launched, or the simulated server
            ...

Simulated means: GPUs are `SimNVML` (the same calls and constants as pynvml), RAPL is a
`SimPowercap` tree whose package power follows the simulated server's busy flag, and the server is
`SimServer` speaking the real protocols. Every output says so (`rig.simulated`, `rig.notes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
from typing import Iterator

from powerprof.collectors.sources import Sources, describe, open_sources
from powerprof.privilege import has_admin_privilege
from powerprof.paths import regular_file_head


def sim_gpu_count_of(sim_profile: str | None, gpus, sim_gpu_count: int | None) -> int:
    """How many GPUs a simulated host has: the one rule for the Rig and the daemon's --check (which checked
    daemon.serving_gpus against --sim-gpus alone: [5] passed it, then the start refused it)."""
    if sim_profile and "," in sim_profile:
        # A mixed host (one profile per GPU): it has as many GPUs as profiles; --gpus then picks among them.
        return len(sim_profile.split(","))
    # A count given is the host (the daemon's --sim-gpus 2: daemon.gpus = [7] then names no GPU of it, said by
    # open_sources; before, 8 were built and gpu7 measured, silently); none given, the indexes asked for make it
    # (`--simulate --gpus 0,1`: two GPUs).
    ints = [g for g in gpus or () if isinstance(g, int)]
    return sim_gpu_count if sim_gpu_count is not None else (max(ints) + 1 if ints else 1)


class Rig:
    """Opened hardware and server for one command; `close()` (or leaving the `with`) releases all of it."""

    def __init__(
        self,
        sim_profile: str | None = None,
        *,
        gpus: list[int] | None = None,
        sim_gpu_count: int | None = None,
        rapl_backend: str = "sysfs",
        host: bool = True,
        nvml=None,
        host_cpu_time: bool | None = None,
        sim_server_gpus: list[int] | None = None,
    ):
        """sim_profile: a simulator profile key, or one per GPU joined by commas (a host of mixed cards: as many GPUs
        as keys), or None for this machine's hardware.
        gpus: NVML indexes, or GPU/MIG UUIDs (default: what CUDA_VISIBLE_DEVICES allows). nvml: an NVML-like object
        to use as given (tests hand in a SimNVML they control). host_cpu_time: judge a busy host from this machine's
        CPU times (default: only where RAPL is real; tests of that judgement set True beside the simulated RAPL).
        sim_server_gpus: the simulated GPUs (indexes) the simulated server runs on, as CUDA_VISIBLE_DEVICES picks a
        real server's (default: the measured GPUs; _sim_server_indexes)."""
        self.sim_profile = sim_profile
        self.host_cpu_time = host_cpu_time
        self.gpus = gpus
        self.rapl_backend = rapl_backend
        self.host = host
        self._busy = False
        self._sources: Sources | None = None
        self._powercap = None
        self._powercap_dir: str | None = None
        self._sim_servers: list = []
        self._bystanders: list = []  # simulated others on the GPU or server (sim_bystander_*), stopped by close()
        self._sim_server_used = False
        self._real_server_used = False
        self._controllers: list = []  # every LimitController handed out: whether any changed a GPU (changed_gpus)
        self._launch_notes: list[str] = []  # what launching a server did besides (a server left by a killed powerprof stopped)
        self._sim_gpu_count = sim_gpu_count_of(sim_profile, gpus, sim_gpu_count)
        self._nvml = nvml
        self._sim_server_gpus = sim_server_gpus

    @property
    def nvml(self):
        """The NVML-like object: as given, the simulator (made on first use), or the real pynvml module."""
        if self._nvml is None:
            if self.simulated:
                from powerprof.sim.nvml import SimNVML

                self._nvml = SimNVML(profile=self.sim_profile, count=self._sim_gpu_count)
            else:
                self._nvml = _pynvml()
        return self._nvml

    @property
    def profile(self):
        """The simulated card's profile (None on real hardware)."""
        return self.nvml.profile if self.simulated else None

    # --- what it is ------------------------------------------------------------------------------

    @property
    def simulated(self) -> bool:
        return self.sim_profile is not None

    @property
    def machine_scope(self) -> str | None:
        """Whose hardware the GPUs are, for the lock every state folder shares (control/gpulock.MachineLock): this
        machine's, or a simulator's state file (each file a GPU of its own; None: one held in this process only)."""
        if not self.simulated:
            return "nvml"
        path = self.nvml.state_path
        return None if path is None else "sim:" + os.path.realpath(path)

    @property
    def label(self) -> str:
        """How every output names these GPUs: "" for real hardware."""
        return f"simulated {self.sim_profile}" if self.simulated else ""

    @property
    def notes(self) -> list[str]:
        """What every output must say about the rig (empty on real hardware with a real server)."""
        if not self.simulated:
            return list(self._launch_notes)
        if self._real_server_used:
            # A simulated GPU beside a real server: its GPU does not see the server's work.
            return [f"SIMULATED GPU ({self.sim_profile}) beside a real server: token timing is real, every energy and "
                    "power figure is the simulator's, not your hardware's"] + self._launch_notes
        what = "simulated GPU and simulated server" if self._sim_server_used else "simulated GPU"
        return [f"{what} ({self.sim_profile}): the figures demonstrate the method, not your hardware"] + self._launch_notes

    @property
    def origin(self) -> dict | None:
        """What a restore file records so `restore` can reopen these GPUs after a crash."""
        if not self.simulated:
            return None
        keys = [g.profile.key for g in self.nvml.gpus]
        origin = {"profile": keys[0] if len(set(keys)) == 1 else ",".join(keys), "count": len(keys)}
        # Which simulated GPUs these are: their state file (simulated UUIDs are the same in every one). Without it,
        # `restore --simulate` under another POWERPROF_SIM_STATE (or `sudo`, which drops it) "restored" a fresh
        # simulator, deleted the record, and the capped one kept its limit with nothing left to restore it.
        state = getattr(self.nvml, "state_path", None)
        if state is not None:
            origin["state_file"] = os.path.realpath(state)
        return origin

    def run_label(self, gpu_name: str) -> str:
        """The GPU's part of a default run-directory name."""
        return ("sim-" + gpu_name.removeprefix("Simulated ")) if self.simulated else gpu_name

    def meta(self) -> dict:
        """The run.json keys that say what was measured: `sim_beside_real_server`, a simulated GPU that does not see
        the real server's work (its power and clocks answer no request: analysis/checks.py says so)."""
        return {"simulated": self.simulated, "sim_profile": self.sim_profile,
                "sim_beside_real_server": self.simulated and self._real_server_used}

    def may_set_limits(self) -> bool:
        if self.simulated:
            return bool(self.nvml.privileged)
        return has_admin_privilege()

    # --- opening ---------------------------------------------------------------------------------

    @property
    def sources(self) -> Sources:
        """The collectors, opened on first use. ValueError for a GPU index that does not exist."""
        if self._sources is None:
            try:
                # The simulated tree inside the try: one failing half-built (out of space) was left behind.
                kw = self._open_sim_powercap() if self.simulated else {}
                self._sources = open_sources(
                    self._nvml if not self.simulated else self.nvml, self.gpus, rapl_backend=self.rapl_backend, host=self.host, privileged=self.may_set_limits, **kw
                )
            except BaseException:
                # Not opened: the simulated tree goes now, not at a close a refused caller may never make (the
                # daemon's refused start left its updater thread writing for the rest of the process).
                self._close_sim_powercap()
                raise
        return self._sources

    def cpu_time_collector(self, url: str | None, launched: list, helpers=None):
        """Whose CPU time the host spends beside the RAPL energy the sources read (collectors/cputime.py), for the
        busy-host flag; None without a server URL, or where that energy is simulated: the simulated package follows
        the simulated server alone, so other processes' CPU time is in none of its joules. helpers: a callable
        giving the pids of powerprof's own child processes (the daemon's proxy workers), counted as powerprof's."""
        real = self.host_cpu_time if self.host_cpu_time is not None else self._powercap is None
        if not url or not real:
            return None
        from powerprof.collectors.cputime import CpuTimeCollector
        from powerprof.workload.serverprocs import ServerProcesses

        return CpuTimeCollector(ServerProcesses(url, launched), helpers=helpers)

    @property
    def sim_powercap(self):
        """The simulated powercap tree (its `root`, true energies), once sources are open; None on real hardware."""
        return self._powercap

    def _open_sim_powercap(self) -> dict:
        from powerprof.sim.nvml import UNPRIVILEGED_ENV
        from powerprof.sim.powercap import SimPowercap, make_sim_powercap_dir

        wl = self.profile.workload
        self._powercap_dir = make_sim_powercap_dir()
        self._powercap = SimPowercap(
            self._powercap_dir,
            power_w_fn=lambda: wl.cpu_idle_w + (wl.cpu_busy_w if self._busy or self._sim_gpus_busy() else 0.0),
            unreadable=os.environ.get(UNPRIVILEGED_ENV) == "1",
        ).start()
        return {"rapl_root": self._powercap_dir, "rapl_opener": self._powercap.opener}

    def _sim_gpus_busy(self) -> bool:
        """A launched simulated server (another process) works the GPUs: the host CPU is busy too."""
        return any(g.read()["phase"].kind != "idle" for g in self.nvml.gpus)

    def describe(self) -> dict:
        """Everything `powerprof devices` shows, JSON-ready."""
        from powerprof.control.restore import pending_restore_note

        return {"simulated": self.simulated, **describe(self.sources), "restore_note": pending_restore_note()}

    def check_server(self, url: str | None, launch: str | list[str] | None) -> None:
        """ValueError, before anything is opened, when `server()` could not give a server."""
        if launch and not url:
            raise ValueError("--launch needs --server URL: where the launched server will listen")
        if not url and not self.simulated:
            raise ValueError("no inference server: give --server URL (or --launch CMD --server URL)")

    @contextlib.contextmanager
    def server(
        self,
        url: str | None = None,
        launch: str | list[str] | None = None,
        *,
        launch_timeout_s: float = 300.0,
        sim_decode_tok_s: float | None = None,
        log_path=None,
        launched: list | None = None,
    ) -> Iterator[str]:
        """The inference server's base URL while the block runs: the given one, one launched with
        `launch` (stopped afterwards, also on error), or the simulated server (on the simulated rig,
        when no URL is given). log_path: where a launched server's output goes (default: a temp file).
        On the simulated rig a launched `python -m powerprof.sim.serve` drives the simulated GPUs
        through the shared state file. launched: a list the ServerLauncher is appended to (its
        death_note() says whether the server died mid-run)."""
        self.check_server(url, launch)
        self._real_server_used = bool(url)
        if launch:
            from powerprof.workload.launcher import ServerLauncher

            env = self._launch_env()
            with ServerLauncher(launch, url, timeout_s=launch_timeout_s, log_path=log_path, env=env) as la:
                self._launch_notes.extend(la.notes)
                if launched is not None:
                    launched.append(la)
                yield url
        elif url:
            yield url
        else:
            with self.sim_server(decode_tok_s=sim_decode_tok_s) as srv:
                yield srv.url

    def _launch_env(self) -> dict | None:
        """A launched server's environment: with --gpus given, CUDA_VISIBLE_DEVICES names the measured GPUs by UUID, a
        GPU named by MIG instance(s) by those instances' UUIDs (CUDA_DEVICE_ORDER=PCI_BUS_ID beside it), so the server
        runs on those and no other; one the user set is kept, and said where it names other GPUs. None: the environment as it is (no --gpus, or no GPU open)."""
        if self.gpus is None or self._sources is None or self._sources.nvml is None:
            return None
        col = self._sources.nvml
        uuids = self._sources.gpu_uuids
        # A GPU named by its MIG instance(s) is given to the server as those instances: its parent's UUID would let
        # CUDA pick whichever instance it lists first, maybe not the one named.
        migs = self._sources.migs
        measured = [u for i in col.indexes for u in ([m.mig_uuid for m in migs if m.parent_index == i] or [uuids[i]])]
        have = os.environ.get("CUDA_VISIBLE_DEVICES")
        if have is None:
            inst = " (MIG instances as named)" if migs else ""
            self._launch_notes.append(f"the launched server sees only the measured GPU(s) {', '.join(map(str, col.indexes))}"
                                      f"{inst}: CUDA_VISIBLE_DEVICES={','.join(measured)} (from --gpus)")
            return dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(measured), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        from powerprof.collectors.gateway import gateway
        from powerprof.collectors.nvml import resolve_gpu_ids

        items = [x.strip() for x in have.split(",") if x.strip()]
        try:
            with gateway(col.nvml).session():
                named, _migs, unknown = resolve_gpu_ids(col.nvml, items)
        except Exception:  # NVML cannot say: judged by the placement check once the server runs
            return None
        if unknown is not None or set(named) != set(col.indexes):
            self._launch_notes.append(
                f"CUDA_VISIBLE_DEVICES={have} (yours, kept for the launched server) names "
                + (f"{unknown}, no GPU of this machine" if unknown is not None
                   else f"GPU(s) {', '.join(map(str, sorted(named))) or 'none'}")
                + f", not the measured GPU(s) {', '.join(map(str, col.indexes))} (--gpus): the server may run on GPUs "
                "not measured, or leave measured ones idle; fix: unset it (powerprof then sets it from --gpus) or make "
                "the two name the same GPUs")
        return None

    def _sim_server_indexes(self) -> list[int] | None:
        """The simulated GPUs the simulated server runs on: sim_server_gpus as given, else $POWERPROF_SIM_SERVER_GPUS
        (indexes, comma-separated: a server beside GPUs not measured, from the command line), else the measured GPUs,
        as a server launched with --gpus (or one that inherits powerprof's CUDA_VISIBLE_DEVICES) runs on those. None:
        every simulated GPU (no GPU open yet). Before, it ran on every simulated GPU whatever --gpus chose, and the
        placement check refused every subset: `--simulate h200-141g,l4-24g --gpus 1` had no way to run."""
        if self._sim_server_gpus is not None:
            return list(self._sim_server_gpus)
        env = os.environ.get("POWERPROF_SIM_SERVER_GPUS", "").strip()
        if env:
            try:
                got = [int(x) for x in env.split(",") if x.strip()]
            except ValueError:
                raise ValueError(f"POWERPROF_SIM_SERVER_GPUS={env!r}: give simulated GPU indexes, e.g. 0,1") from None
            # Before, =5 on a one-GPU rig raised IndexError in the simulated server, and =-1 ran it on the last GPU.
            count = len(self.nvml.gpus)
            if any(not 0 <= i < count for i in got):
                raise ValueError(f"POWERPROF_SIM_SERVER_GPUS={env!r}: simulated GPU indexes run from 0 to {count - 1} "
                                 f"on this rig of {count} GPU(s); give indexes in that range, e.g. 0")
            return got
        if self._sources is not None and self._sources.nvml is not None:
            return list(self._sources.nvml.indexes)
        return None

    def sim_server(self, **kw):
        """A simulated server driving this rig's simulated GPUs; its busy flag drives the simulated CPU power."""
        from powerprof.sim.server import SimServer

        srv = SimServer(self.nvml, gpu_indexes=self._sim_server_indexes(), **kw)
        srv.on_busy(self._set_busy)
        self._sim_server_used = True
        return srv

    def upstream_given(self) -> None:
        """For the daemon: its upstream was configured, not the rig's simulated server (`notes` says so)."""
        self._real_server_used = True

    def default_upstream(self) -> str | None:
        """For the daemon: a simulated server (vLLM flavour, 64 slots, continuous batching, its own thread) when the rig is
        simulated and no upstream is configured; None on real hardware. Stopped by close()."""
        if not self.simulated:
            return None
        srv = self.sim_server(flavour="vllm", n_slots=64, batching="continuous").start()
        self._sim_servers.append(srv)
        return srv.url

    def _set_busy(self, busy: bool) -> None:
        self._busy = busy

    # --- others sharing the simulated GPU or server (misbehaviours for tests and demos) ------------

    def sim_bystander_gpu(self, index: int = 0, power_w: float = 60.0, share: float = 0.3, **kw):
        """Another process's kernels on simulated GPU `index` from now (sim/bystander.py): `power_w` more watts,
        `share` of the GPU's time taken from the server; kw `mem_share`, `enc_share`, `dec_share`: its memory traffic and
        video engines without SM time (all 0: it holds memory and runs nothing). `.stop()` ends it."""
        if not self.simulated:
            raise ValueError("a bystander GPU process is a simulator misbehaviour: open the rig with a sim profile")
        from powerprof.sim.bystander import GpuBystander

        by = GpuBystander(self.nvml, index, power_w, share, **kw).start()
        self._bystanders.append(by)
        return by

    def sim_bystander_client(self, url: str, **kw):
        """Another client sending requests to the server at `url` from now (sim/bystander.py); `.stop()` ends it."""
        if not self.simulated:
            raise ValueError("a bystander client is a simulator misbehaviour: open the rig with a sim profile")
        from powerprof.sim.bystander import ClientBystander

        cl = ClientBystander(url, **kw).start()
        self._bystanders.append(cl)
        return cl

    # --- control -------------------------------------------------------------------------------

    def controller(self, indexes, **kw):
        from powerprof.control.controller import LimitController

        ctl = LimitController(self.nvml, indexes, origin=self.origin, machine_scope=self.machine_scope, **kw)
        self._controllers.append(ctl)
        return ctl

    @property
    def changed_gpus(self) -> bool:
        """Whether a controller of this rig ever changed a GPU's limit or clocks (all put back since, or said)."""
        return any(c.changed for c in self._controllers)

    def restored_line(self, clocks: bool = False) -> str | None:
        """One line for the end of a run that finished normally: each GPU a controller changed, back at its original
        limit (a sweep that ended normally never said so; only the interrupted ones did). None: nothing was changed."""
        parts = []
        for c in self._controllers:
            if c.changed:
                parts += [(d.index, d.limit_w) for d in c.devices]
        if not parts:
            return None
        (i0, w0), rest = parts[0], parts[1:]
        line = f"GPU {i0} back at its original {w0:g} W limit" + "".join(f", GPU {i} at {w:g} W" for i, w in rest)
        return line + (", SM clock locks released" if clocks else "")

    def plan(self, indexes, power_levels=None, clock_levels=None):
        from powerprof.control.plan import make_plan

        return make_plan(self.nvml, indexes, power_levels, clock_levels, permitted=self.may_set_limits(), label=self.label,
                         machine_scope=self.machine_scope)

    def restore(self, path=None, **kw):
        """`powerprof restore`: on the simulated rig only simulated GPUs' records are touched (a real
        GPU is never 'restored' on the simulator and its record then deleted)."""
        from powerprof.control.restore import restore_from_file

        return restore_from_file(path, nvml_factory=_nvml_for_record, refuse=self._refuse_record,
                                 machine_scope=self.machine_scope, **kw)

    def force_default(self, report):
        """`powerprof restore --force-default`: each damaged or untrusted file of `report` is replaced by the
        outcome of setting the GPUs it names (on this rig) to their default limit and removing it."""
        import functools

        from powerprof.control.restore import RestoreReport, force_default

        warnings: list[str] = []  # a machine-wide lock holder passed over while locking a file's GPUs: --json's notes
        outcomes = tuple(self._force_default_one(o, functools.partial(force_default, warnings=warnings))
                         if o.status in ("damaged", "untrusted") else o for o in report.outcomes)
        return RestoreReport(outcomes, searched=report.searched, notes=report.notes,
                             warnings=(*report.warnings, *warnings))

    def _force_default_one(self, outcome, force_default):
        """On the simulated rig only a file provably this simulator's is touched: the UUIDs it names are all its
        GPUs', or, where it names none (cut short), its name is the one a record of some of its GPUs gets (a hash
        of their UUIDs). A damaged file of a real GPU must never be 'defaulted' on the simulator and then deleted:
        the next real run would take the capped limit as the original."""
        from powerprof.control.restore import FileOutcome, gpus_its_name_proves, uuids_named_in

        if not self.simulated:
            return force_default(outcome.path, self.nvml, machine_scope=self.machine_scope)
        if (why := self._other_sim_state({"state_file": state_file_named_in(outcome.path)},
                                         "powerprof restore --simulate --force-default", outcome.path)) is not None:
            # Simulated UUIDs are the same in every state file: a whole but damaged or untrusted record of another
            # one defaulted this simulator's GPUs and was removed, its own GPUs left capped with nothing to say so.
            return FileOutcome(outcome.path, "refused", f"Not changed: {outcome.path} {why}")
        named = set(uuids_named_in(outcome.path) or ())
        ours = {g.uuid for g in self.nvml.gpus}
        if named and named <= ours:
            return force_default(outcome.path, self.nvml, machine_scope=self.machine_scope)
        if not named and (proved := gpus_its_name_proves(outcome.path, ours)):
            done = force_default(outcome.path, self.nvml, machine_scope=self.machine_scope, uuids=proved)
            gpus = ", ".join(f"GPU {g.index}" for g in self.nvml.gpus if g.uuid in proved)
            return dataclasses.replace(done, message=f"{done.message.rstrip(':')} (it names no GPU any more; its "
                                                     f"name is the record of this simulator's {gpus}):"
                                       if done.message.endswith(":") else done.message)
        if not named and (other := _profile_its_name_proves(outcome.path)):
            return FileOutcome(outcome.path, "refused",
                               f"Not changed: {outcome.path} names no GPU that can be read; its name is the record "
                               f"of simulated {other} GPUs, not this simulator's. Run `powerprof restore --simulate "
                               f"{other} --force-default`.")
        why = (f"names GPUs that are not this simulator's ({', '.join(sorted(named - ours))})" if named
               else "names no GPU that can be read, and its name is no record of this simulator's GPUs")
        return FileOutcome(outcome.path, "refused",
                           f"Not changed: {outcome.path} {why}; it may hold a real GPU's original limit. Run "
                           "`powerprof restore --force-default` without --simulate on the GPU's host (if you know "
                           "it was a simulated run's, remove it yourself).")

    def _refuse_record(self, record: dict, path=None) -> str | None:
        if self.simulated and not record.get("simulated"):
            return "records a real GPU; run `powerprof restore` without --simulate."
        return _bad_origin(record.get("simulated")) or self._other_sim_state(record.get("simulated"), path=path)

    def _other_sim_state(self, origin, command: str = "powerprof restore --simulate", path=None) -> str | None:
        """Why a simulated record (restore file `path`) is not this simulator's to restore: its GPUs live in another
        state file (another POWERPROF_SIM_STATE, or `sudo` having dropped it), or in one that is gone. A record of an
        older powerprof names none: it is restored where the environment points, as before. Where root may not use
        that state file's folder (another user's: `untrusted_out_dir`, as the simulator checks it), pointing at it
        cannot work: the routes that do are said instead."""
        recorded = origin.get("state_file") if origin else None
        if recorded is None:
            return None
        from pathlib import Path

        from powerprof.sim.nvml import STATE_ENV, default_state_path
        from powerprof.trust import untrusted_out_dir

        state = getattr(self.nvml, "state_path", None) if self.simulated else None
        here = os.path.realpath(state if state is not None else default_state_path())
        fix = (f"point at it: `{STATE_ENV}={recorded} {command}` (with sudo: "
               f"`sudo env {STATE_ENV}={recorded} {command}`)")
        if not os.path.exists(recorded):
            return (f"records simulated GPUs whose state file {recorded} no longer exists (this simulator's is {here}); "
                    "nothing was changed and the file is kept: if that file comes back, " + fix + "; if it is gone for "
                    "good, so are its simulated limits: delete the restore file")
        if recorded != here and (untrusted := untrusted_out_dir(Path(recorded).parent)):
            # A sudo user's simulated sweep killed -9: root without sudo was told to point at that file, which the
            # simulator then refused ("owned by uid N"), and --force-default was refused both ways.
            where = path if path is not None else "this restore file"
            who = "root" if os.geteuid() == 0 else "this user"
            return (f"records the simulated GPUs of the state file {recorded}, which {who} may not use ({untrusted}); "
                    "nothing was changed and the file is kept. Either the user who owns that folder runs "
                    f"`sudo env {STATE_ENV}={recorded} {command} --restore-file {where}` (sudo trusts its caller's "
                    f"folders), or remove the record: `rm {where}` (it records simulated GPUs only: no real GPU is "
                    f"left capped; the simulated ones keep their level in {recorded})")
        if recorded != here:
            return (f"records the simulated GPUs of the state file {recorded}, not this simulator's ({here}; "
                    f"{STATE_ENV} differs or `sudo` dropped it); nothing was changed and the file is kept: " + fix)
        return None

    # --- life cycle ------------------------------------------------------------------------------

    def close(self) -> None:
        for by in self._bystanders:
            by.stop()
        self._bystanders.clear()
        for srv in self._sim_servers:
            srv.stop()
        self._sim_servers.clear()
        if self._sources is not None:
            self._sources.close()
            self._sources = None
        self._close_sim_powercap()

    def _close_sim_powercap(self) -> None:
        if self._powercap is not None:
            self._powercap.close()
            self._powercap = None
        if self._powercap_dir:
            shutil.rmtree(self._powercap_dir, ignore_errors=True)
            self._powercap_dir = None

    def __enter__(self) -> "Rig":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_STATE_FILE_RE = re.compile(rb'(?<!\\)"state_file":\s*("(?:[^"\\]|\\.)*")')


def state_file_named_in(path) -> str | None:
    """The simulator state file a (possibly damaged) restore file's text names (its "simulated" object's last
    "state_file"), read as `uuids_named_in` reads UUIDs; None where none can be read (cut before it, or no record of a
    simulator): whose state it is is then unknown."""
    from powerprof.control.restore import UUID_SCAN_BYTES

    raw = regular_file_head(path, UUID_SCAN_BYTES)
    if raw is None:
        return None
    for m in reversed(_STATE_FILE_RE.findall(raw)):
        try:
            name = json.loads(m)
        except ValueError:
            continue
        if isinstance(name, str) and os.path.isabs(name) and "\0" not in name:
            return name
    return None


def _profile_its_name_proves(path) -> str | None:
    """The simulated profile some of whose GPUs (indexes 0-7) a restore file's name is the record of, if any: a
    damaged file of a simulated run of another profile is said as that, with the command that acts on it."""
    from powerprof.control.restore import gpus_its_name_proves
    from powerprof.sim.nvml import sim_uuid
    from powerprof.sim.profiles import PROFILES

    for key in PROFILES:
        if gpus_its_name_proves(path, [sim_uuid(key, i) for i in range(8)]):
            return key
    return None


def _pynvml():
    import pynvml

    return pynvml


MAX_SIM_GPUS = 64  # as `--sim-gpus`


def _bad_origin(origin) -> str | None:
    """Why a restore record's simulator origin cannot be reopened as written (a GPU count of true, 1e9 or -1
    would be taken as 1, hang making a billion GPUs, or fail half-way); None when it can, or it names none."""
    if not origin:
        return None
    from powerprof.sim.profiles import PROFILES

    profile, count = origin.get("profile"), origin.get("count")
    keys = profile.split(",") if isinstance(profile, str) else []
    if not keys or any(k not in PROFILES for k in keys):
        why = (f'names the profile {json.dumps(profile)}, not one of {", ".join(sorted(PROFILES))} '
               "(or one per GPU joined by commas)")
    elif type(count) is not int or not 1 <= count <= MAX_SIM_GPUS:
        why = f'has "count" {json.dumps(count)}, not a GPU count in 1..{MAX_SIM_GPUS}'
    elif len(keys) > 1 and len(keys) != count:
        why = f'names {len(keys)} profiles for "count" {count} GPUs'
    elif "state_file" in origin and not (isinstance(origin["state_file"], str) and os.path.isabs(origin["state_file"])
                                         and "\0" not in origin["state_file"]):
        why = f'has "state_file" {json.dumps(origin["state_file"])}, not an absolute path'
    else:
        return None
    return (f'is damaged: its "simulated" {why}. It records simulated GPUs only: correct that field, or delete the '
            "file (the simulator's limits are then as they are).")


def _nvml_for_record(record: dict):
    """The NVML a restore record was made with: the simulator with its profile and GPU count, or pynvml."""
    sim = record.get("simulated")
    if sim:
        from powerprof.sim.nvml import SimNVML

        # Exactly the recorded state file (Rig._other_sim_state refused a record of another one or a gone one).
        return SimNVML(profile=sim["profile"], count=sim["count"], state_path=sim.get("state_file") or True)
    return _pynvml()
