"""Simulated hardware and server: an NVML-compatible GPU, a powercap tree, an inference server."""

from .profiles import DEFAULT_PROFILE, PROFILES, get_profile

__all__ = ["SimNVML", "PROFILES", "DEFAULT_PROFILE", "get_profile"]


def __getattr__(name: str):
    # SimNVML on first use: the CLI imports this package for its options' profile names, and the simulated GPU
    # brings numpy and pynvml (~0.2 s of CPU) into every `powerprof` process, `--help` and `tag` included.
    if name == "SimNVML":
        from .nvml import SimNVML

        return SimNVML
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
