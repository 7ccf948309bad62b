"""Turn sampler Samples into SAMPLES rows for the daemon's samples dataset.

TODO(lead, at merge): the foundation issue adds `powerprof/storage/samples.py` (Sample → SAMPLES
rows for every source, RAPL and host included). Switch `sample_rows` to it then; this version
knows NVML readings and passes other sources through by their attribute names.
"""

from __future__ import annotations

from powerprof.collectors.sampler import Sample
from powerprof.storage.schema import SAMPLES

_COLUMNS = frozenset(f.name for f in SAMPLES)


def sample_rows(sample: Sample, t0_ns: int, gpu_uuids: dict[int, str] | None = None) -> list[dict]:
    base = {
        "time_utc": sample.t_wall_ns,
        "t_mono_s": (sample.t_mono_ns - t0_ns) / 1e9,
        "seq": sample.seq,
        "label": sample.label,
        "source": sample.source,
    }
    if sample.data is None:
        return [dict(base, device=sample.source, error=sample.error or "missing")]
    readings = sample.data if isinstance(sample.data, (list, tuple)) else (sample.data,)
    out = []
    for r in readings:
        row = dict(base)
        for k in _COLUMNS:
            if k not in row and hasattr(r, k):
                row[k] = getattr(r, k)
        if sample.source == "nvml":
            row["device"] = f"gpu{r.index}"
            row["gpu_index"] = r.index
            row["gpu_uuid"] = (gpu_uuids or {}).get(r.index)
        else:
            row["device"] = getattr(r, "device", None) or getattr(r, "name", None) or sample.source
        out.append(row)
    return out
