"""A plug around any NVML-like object that makes chosen calls on chosen GPUs fail or lie, as real cards do.

    nv = FaultyNVML(SimNVML(count=2))
    nv.lose(1)                                                     # GPU 1 falls off the bus (Xid 79)
    nv.fail(0, "nvmlDeviceGetPowerUsage", NVML_ERROR_TIMEOUT)      # one call times out, then fine
    nv.lie(0, "nvmlDeviceGetPowerUsage", lambda mw: 65535000)      # one absurd reading
    nv.lie(0, "nvmlDeviceGetTotalEnergyConsumption", stuck(), times=None)
    nv.reset(0)                                                    # nvidia-smi -r: old handles stale, counter from 0,
                                                                   # default power limit back, clock lock gone
    nv.lock_clocks(0, 900, 900)                                    # another tool's nvidia-smi -lgc 900,900

Wrapping keeps the simulator itself free of fault branches: production code sees an NVML-like
object like any other, and the simulator answers as a healthy card underneath.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import pynvml


@dataclass(frozen=True)
class FaultyHandle:
    """A handle this plug gave out: the wrapped library's, and which reset of its GPU it predates."""

    index: int | None
    generation: int
    inner: Any


@dataclass
class _Rule:
    gpu: int
    fn: str | None  # None: every nvmlDevice* call of that GPU
    code: int | None  # raise NVMLError(code)
    value: Callable[[Any], Any] | None  # or replace the answer
    times: int | None  # None: for ever


class FaultyNVML:
    """Forwards everything to `lib`; calls matched by a rule raise or answer what the rule says."""

    def __init__(self, lib):
        self.lib = lib
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {}
        self._generation: dict[int, int] = {}  # GPU → resets so far: handles from before the last one are stale
        self._stale_code: dict[int, int] = {}
        self._energy_offset_mj: dict[int, int] = {}  # GPU → its counter at the last reset (the counter restarts)
        self._needs_init = False  # a driver reload: every call UNINITIALIZED until nvmlInit again

    def lose(self, gpu: int) -> None:
        """Every call on that GPU fails with NVML_ERROR_GPU_IS_LOST from now on, as after Xid 79."""
        self._add(_Rule(gpu, None, pynvml.NVML_ERROR_GPU_IS_LOST, None, None))

    def fail(self, gpu: int, fn: str, code: int, times: int | None = 1) -> None:
        self._add(_Rule(gpu, fn, code, None, times))

    def lie(self, gpu: int, fn: str, value: Callable[[Any], Any], times: int | None = 1) -> None:
        """`fn` on that GPU answers value(true answer) instead (NVML units: mW, mJ)."""
        self._add(_Rule(gpu, fn, None, value, times))

    def heal(self) -> None:
        with self._lock:
            self._rules.clear()

    def reset(self, gpu: int, code: int = pynvml.NVML_ERROR_GPU_IS_LOST) -> None:
        """GPU `gpu` was reset (nvidia-smi -r, a driver recovery) and is back: every handle taken before
        now fails with `code` (GPU_IS_LOST, INVALID_ARGUMENT; UNINITIALIZED is a driver reload: every call
        fails so until nvmlInit runs again), a handle taken again (by UUID) answers, the energy counter
        restarts from zero, and, as on a real card, the power limit is the default again and any clock lock
        is gone (the wrapped library's `external_reset`, where it has one: the simulator does)."""
        h = self.lib.nvmlDeviceGetHandleByIndex(gpu)
        self.lib.nvmlInit()  # as its own NVML client, like the tool that reset it
        try:
            mj = int(self.lib.nvmlDeviceGetTotalEnergyConsumption(h))
        except pynvml.NVMLError:
            mj = 0
        finally:
            self.lib.nvmlShutdown()
        settings_back = getattr(self.lib, "external_reset", None)
        if settings_back is not None:
            settings_back(gpu)
        with self._lock:
            self._generation[gpu] = self._generation.get(gpu, 0) + 1
            self._stale_code[gpu] = code
            self._energy_offset_mj[gpu] = mj
            if code == pynvml.NVML_ERROR_UNINITIALIZED:
                self._needs_init = True

    def lock_clocks(self, gpu: int, lo_mhz: int, hi_mhz: int) -> None:
        """Another tool runs `nvidia-smi -lgc lo,hi` on GPU `gpu` (through the wrapped library, as any
        other NVML client would): nothing in powerprof is told."""
        self.lib.nvmlInit()
        try:
            self.lib.nvmlDeviceSetGpuLockedClocks(self.lib.nvmlDeviceGetHandleByIndex(gpu), int(lo_mhz), int(hi_mhz))
        finally:
            self.lib.nvmlShutdown()

    def nvmlInit(self, *args) -> None:
        self.lib.nvmlInit(*args)
        with self._lock:
            self._needs_init = False

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def _match(self, name: str, gpu: int | None) -> _Rule | None:
        with self._lock:
            for r in self._rules:
                if r.gpu == gpu and (r.fn is None or r.fn == name):
                    if r.times is not None:
                        r.times -= 1
                        if r.times <= 0:
                            self._rules.remove(r)
                    return r
        return None

    def _wrap(self, handle) -> FaultyHandle:
        gpu = getattr(handle, "index", None)
        with self._lock:
            return FaultyHandle(gpu, self._generation.get(gpu, 0), handle)

    def __getattr__(self, name: str):
        attr = getattr(self.lib, name)
        if not (name.startswith("nvmlDevice") and callable(attr)):
            return attr

        def call(*args, **kw):
            first = args[0] if args else None
            gpu = first if isinstance(first, int) else getattr(first, "index", None)
            with self._lock:
                self.calls[name] = self.calls.get(name, 0) + 1
                if self._needs_init:
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
                if isinstance(first, FaultyHandle) and first.generation < self._generation.get(gpu, 0):
                    raise pynvml.NVMLError(self._stale_code[gpu])
                offset_mj = self._energy_offset_mj.get(gpu, 0) if name == "nvmlDeviceGetTotalEnergyConsumption" else 0
            rule = self._match(name, gpu)
            if rule is not None and rule.code is not None:
                raise pynvml.NVMLError(rule.code)
            args = tuple(a.inner if isinstance(a, FaultyHandle) else a for a in args)
            got = attr(*args, **kw)
            if offset_mj:
                got = max(int(got) - offset_mj, 0)
            if name.startswith("nvmlDeviceGetHandleBy") or name in _HANDLE_GETTERS:
                return self._wrap(got)
            return rule.value(got) if rule is not None else got

        return call


# Calls that give out a handle besides nvmlDeviceGetHandleBy*: wrapped so a reset makes them stale too.
_HANDLE_GETTERS = ("nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetDeviceHandleFromMigDeviceHandle")


def stuck() -> Callable[[int], int]:
    """An energy counter that keeps answering its first value (a stalled counter)."""
    held: list[int] = []

    def value(mj: int) -> int:
        if not held:
            held.append(mj)
        return held[0]

    return value
