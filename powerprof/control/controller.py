"""LimitController: steps the power limit / SM clock of a set of GPUs and always puts them back."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime as _dt
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from powerprof.collectors.gateway import gateway
from powerprof.collectors.nvml import nvml_error_name
from powerprof.errtext import error_text
from powerprof.paths import state_dir
from powerprof.termination import EXTRA_END_SIGNALS, Terminated, clear, note
from powerprof.trust import untrusted_place

from .device import nvml_error_code, read_devices
from .errors import ControlError, ControlPermissionError, PendingRestoreError, RestoreError, StateFolderError
from .errors import permission_message, state_folder_message
from .gpulock import GpuLock, MachineLock, refuse_stray_locks
from .levels import DeviceRange, LevelError, common_power_range, describe_power_range
from .levels import parse_clock_levels, parse_power_levels
from .restore import (
    DEFAULT_TOLERANCE_W,
    default_restore_path,
    new_record,
    pending_blocker,
    remove_file,
    restore_gpu,
    state_folder_refusal,
    write_json_atomic,
)
from .setter import GpuReadback, NvidiaSmi, check_applied, lock_sm_clocks, reset_sm_clocks, run_nvidia_smi
from .setter import set_power_limit

# SIGUSR1 too: its default action kills, and `kill -USR1` meant for the tuner can reach a sweep; restore, then exit.
# SIGQUIT, SIGUSR2, SIGALRM, SIGXCPU, SIGVTALRM too (termination.EXTRA_END_SIGNALS): each killed the process with the
# GPU left capped, silently.
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1) + EXTRA_END_SIGNALS


@dataclass(frozen=True)
class LimitReadback:
    """One level as set: the same requested watts on every GPU, and what each GPU reads back."""

    level_w: float
    gpus: tuple[GpuReadback, ...]
    t_mono_ns: int
    t_utc: _dt.datetime


class LimitController:
    """Controller for a set of GPUs that all take the same level (a server split across cards).

        with LimitController(nvml, [0, 1]) as ctl:      # locks, originals, permission; nothing changed yet
            for w in ctl.parse_power_levels("180,220W,60%"):
                readback = ctl.set_power_limit_w(w)
        # every GPU is back at its original limit and clocks are released

    Restores on leaving the block (normally or by exception), on SIGINT/SIGTERM/SIGHUP/SIGUSR1 and the other run-ending signals (then exits
    non-zero), and at interpreter exit as a last resort. Use it from the main thread: that is where
    Python delivers signals.
    """

    def __init__(
        self,
        nvml,
        indexes: Sequence[int],
        *,
        restore_path: Path | str | None = None,
        state_dir_path: Path | str | None = None,
        nvidia_smi: NvidiaSmi = run_nvidia_smi,
        tolerance_w: float = DEFAULT_TOLERANCE_W,
        handle_signals: bool = True,
        origin: dict | None = None,
        machine_scope: str | None = None,
    ):
        """`origin`: how `restore` reopens these GPUs after a crash (the door's words, stored in the
        restore file as they are; None for real GPUs through pynvml). `machine_scope`: whose hardware these GPUs
        are, for the lock every state folder shares (gpulock.MachineLock): the door's word (rig.Rig.machine_scope, the
        only maker of controllers), "nvml" for this machine's GPUs; None: no such lock."""
        if not indexes:
            raise LevelError(["no GPU selected"], "Select at least one GPU.")
        self.nvml = nvml
        self.indexes = list(indexes)
        self.state_dir = Path(state_dir_path) if state_dir_path is not None else state_dir()
        self._restore_path_arg = Path(restore_path) if restore_path is not None else None
        self.restore_path: Path | None = self._restore_path_arg
        self.nvidia_smi = nvidia_smi
        self.tolerance_w = float(tolerance_w)
        self.handle_signals = handle_signals
        self.origin = origin
        self.machine_scope = machine_scope
        self.devices: tuple[DeviceRange, ...] = ()
        self._handles: list = []
        self._locks: list[GpuLock | MachineLock] = []
        # "skipped: budget (where)" where this open's check for a root controller whose lock file was taken out of the
        # lock folder ran out of its budget (fail-open: such a controller was not refused); None: checked, or no check.
        self.stray_lock_check_skipped: str | None = None
        self._record: dict | None = None  # the restore record once written: our "dirty" flag
        # Whether a GPU was ever changed (the record was written), kept after the restore: a command may only say
        # "every GPU is back" where one was changed (it said so after a sweep that never reached a GPU).
        self.changed = False
        self._active = False
        self._nvml_open = False
        self._mutex = threading.RLock()
        self._busy = 0
        self._pending_signal: int | None = None
        self._exit_raised = False  # this controller's handler has raised a run-ending exit
        self._prev_handlers: dict[int, object] = {}
        self._atexit_registered = False
        # What happened to the GPUs that the caller must say (a GPU reset under us, reopened by its UUID).
        self.notes: list[str] = []

    # --- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "LimitController":
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _refuse_untrusted_state_dir(self) -> None:
        """As root: the locks and the restore file go where only root could have written (a symlink planted in a
        folder others can write would lead root's writes anywhere, and a planted restore file would set limits)."""
        why = state_folder_refusal(self.state_dir)
        if why:
            raise ControlError(why)
        # A restore file given apart from the state folder: the same rule, or `powerprof restore` would refuse it after
        # a crash (untrusted) and leave the GPU capped, and its folder's owner could replace it with limits of theirs.
        why = self._restore_path_arg is not None and untrusted_place(self._restore_path_arg)
        if why:
            raise ControlError(
                f"restore file {self._restore_path_arg}: refusing to write it there as root: {why}; another user could "
                "replace it, and `powerprof restore` would refuse it after a crash. Fix: give a path in a folder of "
                "root's own, or none (the state folder's default)")

    def open(self) -> None:
        """Lock the GPUs, read their originals, check permission. Changes nothing on the GPU."""
        if self._active:
            return
        try:
            gateway(self.nvml).init()
            self._nvml_open = True
            self.devices = read_devices(self.nvml, self.indexes)
            self._handles = [gateway(self.nvml).call("nvmlDeviceGetHandleByIndex", i) for i in self.indexes]
            self._refuse_untrusted_state_dir()
            for d in self.devices:
                lock = GpuLock(self.state_dir, d.uuid, d.index)
                lock.acquire()
                self._locks.append(lock)
                if self.machine_scope is not None:
                    machine = MachineLock(self.machine_scope, d.uuid, d.index)
                    machine.acquire()
                    self._locks.append(machine)
            # Once for every GPU: a root controller whose lock file was taken out of the lock folder (never `restore`).
            self.stray_lock_check_skipped = refuse_stray_locks(
                [lock for lock in self._locks if isinstance(lock, MachineLock)])
            # Read the originals again under the lock: another controller may have been restoring until now.
            self.devices = read_devices(self.nvml, self.indexes)
            self._refuse_if_pending_restore()
            self._check_permission()
            if self.restore_path is None:
                self.restore_path = default_restore_path([d.uuid for d in self.devices], self.state_dir)
        except BaseException:
            self._release_resources()
            raise
        self._active = True
        self._exit_raised = False
        self._install_handlers()
        atexit.register(self._atexit)
        self._atexit_registered = True

    def close(self) -> None:
        """Restore (if anything was changed), then release locks and handlers. Idempotent."""
        if not self._active:
            return
        self._busy += 1  # a second Ctrl-C must not cut the restore short
        try:
            self._restore_now()
        finally:
            self._busy -= 1
            self._active = False
            self._release_resources()
            if self._atexit_registered:
                atexit.unregister(self._atexit)
                self._atexit_registered = False
            try:
                self._deliver_pending_signal()  # while our handler is still installed: it exits 128+signum
            finally:
                self._uninstall_handlers()

    def _release_resources(self) -> None:
        for lock in reversed(self._locks):
            lock.release()
        self._locks.clear()
        if self._nvml_open:
            self._nvml_open = False
            try:
                gateway(self.nvml).shutdown()
            except Exception:
                pass

    def _refuse_if_pending_restore(self) -> None:
        extra = [self._restore_path_arg] if self._restore_path_arg is not None and self._restore_path_arg.exists() else []
        why = pending_blocker([d.uuid for d in self.devices], self.state_dir, extra)
        if why:
            raise PendingRestoreError(why)

    def _check_permission(self) -> None:
        """Setting each GPU's limit to its current value proves permission without changing anything."""
        for h, d in zip(self._handles, self.devices):
            try:
                gateway(self.nvml).call("nvmlDeviceSetPowerManagementLimit", h, int(round(d.limit_w * 1000)))
            except self.nvml.NVMLError as e:
                code = nvml_error_code(self.nvml, e)
                if code == self.nvml.NVML_ERROR_NO_PERMISSION:
                    raise ControlPermissionError(permission_message("change GPU power limits")) from e
                # NotSupported: the nvidia-smi fallback will be tried and reports its own permission error;
                # anything else is left to the real set, which turns it into an error and restores.

    # --- levels ------------------------------------------------------------------------------

    def parse_power_levels(self, spec: str | Iterable) -> list[float]:
        self._require_active()
        return parse_power_levels(spec, self.devices)

    def parse_clock_levels(self, spec: str | Iterable) -> list[int]:
        self._require_active()
        return parse_clock_levels(spec, self.devices)

    @property
    def original_limits_w(self) -> tuple[float, ...]:
        return tuple(d.limit_w for d in self.devices)

    # --- changes -----------------------------------------------------------------------------

    def set_power_limit_w(self, watts: float) -> LimitReadback:
        """Every GPU to `watts`, each read back. A set that did not take effect restores and raises."""
        self._require_active()
        lo, hi = common_power_range(self.devices)
        if not lo <= watts <= hi:
            raise LevelError([f"{watts:g} W is outside the allowed range"], describe_power_range(self.devices))
        self._reclaim_names()
        with self._critical():
            self._ensure_record()
            try:
                rbs = tuple(
                    set_power_limit(self.nvml, h, d.index, d.uuid, float(watts), self.nvidia_smi)
                    for h, d in self._reached()
                )
                check_applied(rbs, self.tolerance_w)
            except BaseException:
                self._restore_after_failure()
                raise
            return LimitReadback(float(watts), rbs, time.monotonic_ns(), _dt.datetime.now(_dt.timezone.utc))

    def lock_sm_clock_mhz(self, lo_mhz: int, hi_mhz: int | None = None) -> None:
        """Lock every GPU's SM clock to [lo, hi] (hi defaults to lo). Released on restore."""
        self._require_active()
        hi_mhz = lo_mhz if hi_mhz is None else hi_mhz
        if lo_mhz > hi_mhz:
            raise LevelError([f"clock range {lo_mhz}-{hi_mhz} MHz is reversed"], "Give the lower clock first.")
        for mhz in {int(lo_mhz), int(hi_mhz)}:  # raises if out of range (each alone: a range's ends may share a clock)
            parse_clock_levels([str(mhz)], self.devices)
        self._reclaim_names()
        with self._critical():
            self._ensure_record()
            # Marked before the call: a kill right after the lock takes effect must still release it.
            self._mark_clocks(True)
            try:
                for h, d in self._reached():
                    lock_sm_clocks(self.nvml, h, d.index, lo_mhz, hi_mhz)
            except BaseException:
                self._restore_after_failure()
                raise

    def release_clocks(self) -> None:
        """Reset the clock lock on every GPU powerprof locked (the power limit stays where it is)."""
        self._require_active()
        with self._critical():
            if not self._record or not any(g["clocks_locked"] for g in self._record["gpus"].values()):
                return
            for h, d in self._reached():
                if self._record["gpus"][d.uuid]["clocks_locked"]:
                    reset_sm_clocks(self.nvml, h, d.index)
            self._mark_clocks(False)

    def restore(self) -> None:
        """Every GPU back to its original limit, clock locks released, restore file removed. Idempotent."""
        with self._critical():
            self._restore_now()

    # --- internals ---------------------------------------------------------------------------

    def _reclaim_names(self) -> None:
        """Each machine-wide lock name root passed over (a squatter held it): bound now where it is free, and kept;
        GpuBusyError, before any change, where a controller took it meanwhile (`MachineLock.reclaim`)."""
        for lock in self._locks:
            if isinstance(lock, MachineLock):
                lock.reclaim()

    def _require_active(self) -> None:
        if not self._active:
            raise ControlError("LimitController is not open: use it as `with LimitController(...) as ctl:`.")

    def _reached(self):
        """(handle, device) per GPU, each handle checked to still reach its GPU first (`_handle`)."""
        return [(self._handle(k), self.devices[k]) for k in range(len(self.devices))]

    def _handle(self, k: int):
        """GPU k's handle, looked up again by its UUID (never by index: a reset may renumber GPUs) when the one
        held stopped reaching it: a GPU reset (nvidia-smi -r, a driver recovery) makes old handles stale
        (GPU_IS_LOST, INVALID_ARGUMENT) and a driver reload ends NVML's session (UNINITIALIZED). Without this,
        every later level and the final restore failed on the stale handle and the GPU kept what the reset left.
        The old handle stays when the same GPU cannot be found again: the call then says why (a GPU off the bus)."""
        gw = gateway(self.nvml)
        h, d = self._handles[k], self.devices[k]
        got, code = gw.attempt("nvmlDeviceGetUUID", h)
        if code is None and got == d.uuid:
            return h
        uninit = getattr(self.nvml, "NVML_ERROR_UNINITIALIZED", None)
        try:
            if code is not None and code == uninit:
                gw.reinit()
            new, _ = gw.attempt("nvmlDeviceGetHandleByUUID", d.uuid)
            if new is None or gw.attempt("nvmlDeviceGetUUID", new)[0] != d.uuid:
                return h
        except Exception:  # noqa: BLE001 - NVML cannot start again: the call on the old handle says why
            return h
        self._handles[k] = new
        index, _ = gw.attempt("nvmlDeviceGetIndex", new)
        moved = index is not None and int(index) != d.index
        if moved:
            self.devices = tuple(dataclasses.replace(x, index=int(index)) if j == k else x for j, x in enumerate(self.devices))
            if self._record is not None:
                self._record["gpus"][d.uuid]["index"] = int(index)
                write_json_atomic(self.restore_path, self._record)
        why = nvml_error_name(self.nvml, code) if code is not None else "another GPU's UUID"
        note = (f"GPU {d.index} ({d.uuid}) was reset or its driver reloaded during the run (its NVML handle answered "
                f"{why}): reopened by its UUID" + (f", now GPU {int(index)}" if moved else "") + "; a reset puts the "
                "default power limit back and releases clock locks, so what was set before it no longer held; "
                "later settings and the restore went to the reopened GPU")
        if note not in self.notes:
            self.notes.append(note)
        return new

    def _ensure_record(self) -> None:
        if self._record is not None:
            return
        gpus = {
            d.uuid: {
                "index": d.index,
                "name": d.name,
                "original_limit_mw": int(round(d.limit_w * 1000)),
                "default_limit_mw": int(round(d.default_w * 1000)),
                "clocks_locked": False,
            }
            for d in self.devices
        }
        record = new_record(gpus, self.origin)
        try:
            write_json_atomic(self.restore_path, record)
        except OSError as e:  # before the first change: nothing to put back (a bare `[Errno 28]` before)
            raise StateFolderError(state_folder_message("the restore file", self.restore_path, e)) from None
        self._record = record
        self.changed = True

    def _mark_clocks(self, locked: bool) -> None:
        for g in self._record["gpus"].values():
            g["clocks_locked"] = locked
        write_json_atomic(self.restore_path, self._record)

    def _restore_now(self) -> None:
        with self._mutex:
            if self._record is None:
                return
            problems = []
            for k in range(len(self.devices)):
                d = self.devices[k]
                try:
                    h = self._handle(k)
                    d = self.devices[k]
                    restore_gpu(self.nvml, h, d.index, d.uuid, self._record["gpus"][d.uuid], self.nvidia_smi, self.tolerance_w)
                except ControlError as e:
                    problems.append(str(e))
                except Exception as e:  # noqa: BLE001 - every GPU gets its try; the kept file says what to run
                    # An OSError (the simulator's state write, a full disk), a bug: it ended the restore at this GPU,
                    # the others left capped, and the message was the errno alone.
                    problems.append(f"GPU {d.index} ({d.uuid}): putting back its limit failed: {error_text(e)}.")
            if problems:
                raise RestoreError(
                    "Could not put every GPU back: " + " ".join(problems)
                    + f" Restore file kept: run `powerprof restore --restore-file {self.restore_path}` once the cause "
                    "is fixed."
                )
            try:
                remove_file(self.restore_path)
            except OSError as e:
                # Every GPU is back; only the record stays (a read-only file system, an immutable file). Unsaid, it
                # ended the sweep with a bare errno and blocked every later run on these GPUs unexplained.
                self._record = None
                raise RestoreError(
                    f"every GPU is back at its original limit; the restore file {self.restore_path} could not be removed "
                    f"({e.strerror or error_text(e)}): remove it, or run `powerprof restore --restore-file "
                    f"{self.restore_path}` (it blocks new runs on these GPUs until then)") from None
            self._record = None

    def _restore_after_failure(self) -> None:
        try:
            self._restore_now()
        except RestoreError as e:
            # The original error is the one to report; the kept file and close() try again. Where every GPU is back and
            # only the file stayed, close() has nothing left to retry: keep its words for the caller's notes.
            if self._record is None and str(e) not in self.notes:
                self.notes.append(str(e))
        except Exception:  # noqa: BLE001 - as above: the original error is the one to report
            pass

    # --- signals -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _critical(self):
        """Signals that arrive in here wait until the change/restore is complete and recorded."""
        with self._mutex:
            self._busy += 1
            try:
                yield
            finally:
                self._busy -= 1
        self._deliver_pending_signal()

    def _deliver_pending_signal(self) -> None:
        if self._busy == 0 and self._pending_signal is not None:
            signum, self._pending_signal = self._pending_signal, None
            signal.raise_signal(signum)

    def _install_handlers(self) -> None:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for s in HANDLED_SIGNALS:
            prev = signal.getsignal(s)
            if prev is signal.SIG_IGN:
                continue  # e.g. SIGHUP under nohup: the user asked to keep running
            self._prev_handlers[s] = prev
            signal.signal(s, self._on_signal)

    def _uninstall_handlers(self) -> None:
        for s, prev in self._prev_handlers.items():
            try:
                if signal.getsignal(s) == self._on_signal:
                    signal.signal(s, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, TypeError):
                pass
        if self._prev_handlers:
            clear()  # this controller's run is over: a noted signal has been acted on
        self._prev_handlers.clear()

    def _on_signal(self, signum, frame) -> None:
        if self._busy:
            self._pending_signal = signum
            return
        # Not inside a change: restore right here, so the GPU is back even if a caller swallows the exception.
        # Busy while it does: a second Ctrl-C within those milliseconds must not start a second restore inside
        # the first (re-entering NVML from a signal handler: a hang on the simulator's lock, a traceback on
        # real GPUs); it asks for the exit this handler raises just below, so it is dropped.
        self._busy += 1
        try:
            self._restore_now()
        except Exception:
            pass  # close() and atexit retry; the restore file stays until one succeeds
        finally:
            self._busy -= 1
            self._pending_signal = None
        if self._exit_raised:
            # A repeat signal while the first one's exit unwinds through cleanup (the sweep writing its
            # finished levels, close() restoring): raising again would cut that cleanup short and end in a
            # traceback. The GPUs are back (above); the exit already under way ends the run, and the latch
            # re-raises it before the next request should a caller have swallowed it.
            note(signum)
            return
        self._exit_raised = True
        note(signum)  # re-raised before the next request should this exit be swallowed
        prev = self._prev_handlers.get(signum)
        if callable(prev) and prev is not signal.default_int_handler:
            prev(signum, frame)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)  # a SystemExit(128 + signum) the commands say "stopped by SIG…" for

    def _atexit(self) -> None:
        try:
            self.close()
        except Exception:
            pass
