"""Simulated hardware and server: an NVML-compatible GPU, a powercap tree, an inference server."""

from .profiles import DEFAULT_PROFILE, PROFILES, get_profile

__all__ = ["SimNVML", "PROFILES", "DEFAULT_PROFILE", "get_profile"]


_PIP_NAMES = {"pynvml": "nvidia-ml-py"}  # a missing module's pip package, where the names differ


def __getattr__(name: str):
    # SimNVML on first use: the CLI imports this package for its options' profile names, and the simulated GPU
    # brings numpy and pynvml (~0.2 s of CPU) into every `powerprof` process, `--help` and `tag` included.
    if name == "SimNVML":
        try:
            from .nvml import SimNVML
        except ModuleNotFoundError as e:
            if not e.name or e.name.split(".")[0] == "powerprof":
                raise
            # AttributeError, the cause chained: hasattr() and introspection (mock's autospec, doctest) answer "no"
            # instead of raising; an access says what is missing and the fix.
            raise AttributeError(f"powerprof.sim.SimNVML needs {e.name}, which cannot be imported ({e}): install it "
                                 f"(`pip install {_PIP_NAMES.get(e.name, e.name)}`)", name=name) from e
        globals()["SimNVML"] = SimNVML  # once: later accesses do not come here
        return SimNVML
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "SimNVML"})
