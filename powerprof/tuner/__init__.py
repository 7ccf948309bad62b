"""`powerprof tune`: find and hold the power-limit (or SM-clock) sweet spot on live traffic under a latency SLO."""
