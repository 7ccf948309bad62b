"""Sampler Samples → SAMPLES rows for the daemon's samples dataset, in the daemon store's units."""

from __future__ import annotations

from powerprof.collectors.sampler import Sample
from powerprof.storage import samples as _samples


def sample_rows(sample: Sample, t0_ns: int, gpu_uuids: dict[int, str] | None = None) -> list[dict]:
    """storage.samples.sample_rows, with `time_utc` in nanoseconds as the daemon's store takes it."""
    rows = _samples.sample_rows(sample, t0_ns, gpu_uuids)
    for r in rows:
        r["time_utc"] = r["time_utc"] * 1000
    return rows
