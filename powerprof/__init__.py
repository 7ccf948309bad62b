"""powerprof: power and efficiency profiler for GPUs that serve LLMs."""

__version__ = "0.1.0"
