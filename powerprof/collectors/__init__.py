"""Collectors (NVML, RAPL, host) and the sampler that runs them on one schedule."""
