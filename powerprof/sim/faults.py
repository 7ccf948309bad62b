"""A plug around any NVML-like object that makes chosen calls on chosen GPUs fail or lie, as real cards do.

    nv = FaultyNVML(SimNVML(count=2))
    nv.lose(1)                                                     # GPU 1 falls off the bus (Xid 79)
    nv.fail(0, "nvmlDeviceGetPowerUsage", NVML_ERROR_TIMEOUT)      # one call times out, then fine
    nv.lie(0, "nvmlDeviceGetPowerUsage", lambda mw: 65535000)      # one absurd reading
    nv.lie(0, "nvmlDeviceGetTotalEnergyConsumption", stuck(), times=None)

Wrapping keeps the simulator itself free of fault branches: production code sees an NVML-like
object like any other, and the simulator answers as a healthy card underneath.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import pynvml


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

    def __getattr__(self, name: str):
        attr = getattr(self.lib, name)
        if not (name.startswith("nvmlDevice") and callable(attr)):
            return attr

        def call(*args, **kw):
            first = args[0] if args else None
            gpu = first if isinstance(first, int) else getattr(first, "index", None)
            with self._lock:
                self.calls[name] = self.calls.get(name, 0) + 1
            rule = self._match(name, gpu)
            if rule is not None and rule.code is not None:
                raise pynvml.NVMLError(rule.code)
            got = attr(*args, **kw)
            return rule.value(got) if rule is not None else got

        return call


def stuck() -> Callable[[int], int]:
    """An energy counter that keeps answering its first value (a stalled counter)."""
    held: list[int] = []

    def value(mj: int) -> int:
        if not held:
            held.append(mj)
        return held[0]

    return value
