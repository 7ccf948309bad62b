"""Simulated hardware and server: an NVML-compatible GPU, a powercap tree, an inference server."""

from .nvml import SimNVML
from .profiles import DEFAULT_PROFILE, PROFILES, get_profile

__all__ = ["SimNVML", "PROFILES", "DEFAULT_PROFILE", "get_profile"]
