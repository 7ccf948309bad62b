"""Which GPUs the server's processes hold a context on, against the GPUs measured: a server GPU left unmeasured, a measured GPU the server does not use.

NVML lists the processes using each GPU; the server's are found by its port or launch (serverprocs.py). Every GPU
NVML reports is looked at, not only the measured ones: a server on GPUs 0 and 1 measured on GPU 1 alone has half its
energy in no figure, and its limit stepped on one GPU of two. Where the server's processes cannot be found (a remote
server, a socket list this user may not read) or none of them is on any GPU's list (a container's own pid namespace),
nothing can be told and nothing is said here (GpuNeighbours, others.py, says the latter of the measured GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class GpuPlacementError(ValueError):
    """The server runs on a GPU that is not measured (sweep, measure): refused before anything is measured or changed,
    exit 2 (the --gpus given, or left out, are the mistake)."""


@dataclass
class Placement:
    """server: index → UUID of every GPU holding one of the server's processes; measured: index → UUID of the GPUs
    measured; unlisted: GPUs whose process list NVML cannot give (the server may be on them too)."""

    server: dict[int, str]
    measured: dict[int, str]
    unlisted: list[int] = field(default_factory=list)

    @property
    def unmeasured(self) -> dict[int, str]:
        """The server's GPUs that are not measured."""
        return {i: u for i, u in self.server.items() if i not in self.measured}

    @property
    def idle(self) -> dict[int, str]:
        """Measured GPUs holding none of the server's processes (empty where the server is on no GPU's list: unknown)."""
        if not self.server:
            return {}
        return {i: u for i, u in self.measured.items() if i not in self.server and i not in self.unlisted}

    def gpus_option(self) -> str:
        """The --gpus that measures every GPU the server uses and no other."""
        return ",".join(str(i) for i in sorted(self.server))

    def visible_fix(self) -> str:
        """The fix where the GPUs measured are those CUDA_VISIBLE_DEVICES shows (measure has no --gpus)."""
        return ("measure the GPUs CUDA_VISIBLE_DEVICES shows powerprof: run it with CUDA_VISIBLE_DEVICES="
                + ",".join(u or str(i) for i, u in sorted(self.server.items())))

    def unmeasured_text(self, fix: str | None = None, cost: str | None = None) -> str | None:
        """'the server also runs on GPU 0 (GPU-…): …; add it: --gpus 0,1', or None when every server GPU is measured.
        cost: what leaving it out costs, in words (default a sweep's: its energy in no figure, its limit not stepped)."""
        gone = self.unmeasured
        if not gone:
            return None
        what = ", ".join(gpu_name(i, u) for i, u in sorted(gone.items()))
        one = len(gone) == 1
        its = "its" if one else "their"
        return (f"the server also runs on {what}, which {'is' if one else 'are'} not measured: "
                + (cost or f"{its} energy would be in no figure (J/token low) and {its} limit not stepped") + "; "
                + (fix or f"add {'it' if one else 'them'}: --gpus {self.gpus_option()}"))

    def idle_text(self, fix: str | None = None, cost: str | None = None) -> str | None:
        """The measured GPUs the server does not use, in words with the fix, or None. cost: what measuring them costs,
        in words (default a sweep's and measure's: their idle power in every figure, their limit stepped for nothing)."""
        idle = self.idle
        if not idle:
            return None
        what = ", ".join(gpu_name(i, u) for i, u in sorted(idle.items()))
        one = len(idle) == 1
        its = "its" if one else "their"
        return (f"{what} {'holds' if one else 'hold'} none of the server's processes (the server runs on "
                f"{', '.join(gpu_name(i, u) for i, u in sorted(self.server.items()))}): "
                + (cost or f"{its} idle power is in every GPU energy and J/token figure, and a sweep steps {its} limit "
                           "for nothing") + "; "
                + (fix or f"measure only the server's GPUs: --gpus {self.gpus_option()}"))


def gpu_name(index: int, uuid: str | None) -> str:
    """'GPU 0 (GPU-…)', as the messages name a GPU."""
    return f"GPU {index}" + (f" ({uuid})" if uuid else "")


def find_placement(nvml, measured: dict[int, str], server_procs) -> Placement | None:
    """Where the server's processes hold a context, over every GPU NVML reports (NVML initialised by the caller: an
    open collector). measured: index → UUID of the GPUs measured. server_procs: a callable answering (pids, None) or
    (None, why) (serverprocs.ServerProcesses). None where nothing can be told: the server's processes unknown, NVML
    unable to count its GPUs, or none of the server's processes on any GPU's list (another pid namespace)."""
    from powerprof.collectors.gateway import gateway
    from powerprof.collectors.nvml import gpu_processes

    if server_procs is None:
        return None
    pids, _why = server_procs()
    if not pids:
        return None
    gw = gateway(nvml)
    count = gw.query("nvmlDeviceGetCount")
    if not isinstance(count, int):
        return None
    server: dict[int, str] = {}
    unlisted: list[int] = []
    for i in range(count):
        h = gw.query("nvmlDeviceGetHandleByIndex", i)
        procs = gpu_processes(nvml, h) if h is not None else None
        if procs is None:
            unlisted.append(i)
            continue
        if set(procs) & pids:
            server[i] = measured.get(i) or gw.query("nvmlDeviceGetUUID", h)
    if not server:
        return None
    return Placement(server, dict(measured), unlisted)
