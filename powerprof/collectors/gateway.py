"""The one way into NVML: every reader and setter calls through here (init counting, bytes to str, missing answers as None).

Like nvitop's `nvmlQuery`: `gw.query("nvmlDeviceGetPowerUsage", h)` answers None where the GPU or
driver cannot (NotSupported, NoPermission, a function the bindings lack), so a missing reading is
never a zero; `gw.call(...)` raises the NVMLError for calls whose failure the caller must handle
(setters, the limits a controller will not act without). The wrapped library is whatever the door
hands in: the `pynvml` module or an NVML-like object (the simulator); constants and error classes
are read from it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any


def as_text(v: Any) -> str:
    """NVML strings arrive as bytes from older bindings and str from newer ones."""
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


class NvmlGateway:
    """Wraps an NVML library once; attribute access (constants, NVMLError) falls through to it."""

    def __init__(self, lib):
        self.lib = lib
        self._lock = threading.Lock()
        self._opened = 0

    def __getattr__(self, name: str):
        return getattr(self.lib, name)

    # --- init/shutdown: counted, so nested users do not shut NVML down under each other ---------

    def init(self) -> None:
        with self._lock:
            self.lib.nvmlInit()
            self._opened += 1

    def shutdown(self) -> None:
        with self._lock:
            if self._opened == 0:
                return
            self._opened -= 1
            try:
                self.lib.nvmlShutdown()
            except self.lib.NVMLError:
                pass

    def reinit(self) -> None:
        """Start NVML again under every user, keeping the count: after a driver reload the old session
        answers NVML_ERROR_UNINITIALIZED to every call."""
        with self._lock:
            if self._opened == 0:
                return
            try:
                self.lib.nvmlShutdown()
            except self.lib.NVMLError:
                pass
            self.lib.nvmlInit()

    @contextlib.contextmanager
    def session(self):
        self.init()
        try:
            yield self
        finally:
            self.shutdown()

    # --- calls ---------------------------------------------------------------------------------

    def call(self, fn: str, *args):
        """`fn(*args)`, raising the library's NVMLError on failure; bytes become str."""
        v = getattr(self.lib, fn)(*args)
        return as_text(v) if isinstance(v, bytes) else v

    def query(self, fn: str, *args, default=None):
        """`fn(*args)`, or `default` where NVML cannot answer (unsupported, no permission, unknown
        function): a missing reading stays missing."""
        f = getattr(self.lib, fn, None)
        if f is None:
            return default
        try:
            v = f(*args)
        except self.lib.NVMLError:
            return default
        return as_text(v) if isinstance(v, bytes) else v

    def attempt(self, fn: str, *args) -> tuple[Any, int | None]:
        """(answer, None), or (None, the NVML return code) where it failed; a function the bindings
        lack is NOT_SUPPORTED. For readers that must tell "cannot" from "failed" (a GPU lost)."""
        f = getattr(self.lib, fn, None)
        if f is None:
            return None, getattr(self.lib, "NVML_ERROR_NOT_SUPPORTED", 3)
        try:
            v = f(*args)
        except self.lib.NVMLError as e:
            return None, getattr(e, "value", None)
        return (as_text(v) if isinstance(v, bytes) else v), None

    def error_code(self, exc: BaseException) -> int | None:
        """The NVML return code of an NVMLError, None for any other exception."""
        return getattr(exc, "value", None) if isinstance(exc, self.lib.NVMLError) else None


_GATEWAYS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_GATEWAYS_LOCK = threading.Lock()


def gateway(nvml) -> NvmlGateway:
    """The one gateway for the library `nvml` (the same object for every caller, so init/shutdown
    are counted across them); a gateway is returned as it is."""
    if isinstance(nvml, NvmlGateway):
        return nvml
    with _GATEWAYS_LOCK:
        try:
            gw = _GATEWAYS.get(nvml)
        except TypeError:  # not weak-referenceable: a gateway of its own
            return NvmlGateway(nvml)
        if gw is None:
            gw = _GATEWAYS[nvml] = NvmlGateway(nvml)
        return gw
