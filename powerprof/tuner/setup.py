"""The [tuner] section: read from a TOML file root can trust, levels resolved against the GPUs by the controller."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from powerprof.control.restore import untrusted_reason

from .policy import TunerConfig, TunerConfigError, config_from_table

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def load_table(path: Path | None, euid: int | None = None) -> dict:
    """The [tuner] table of `path` ({} without a file). As root the file must be root's and writable by no one else:
    its levels and SLO decide what root does to the GPUs."""
    if path is None:
        return {}
    euid = os.geteuid() if euid is None else euid
    if euid == 0:
        why = untrusted_reason(Path(path), euid=0)
        if why:
            raise TunerConfigError(f"not using {path}: {why}")
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise TunerConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise TunerConfigError(f"{path}: not valid TOML ({e})") from None
    extra = sorted(set(raw) - {"tuner"})
    if extra:
        raise TunerConfigError(f"{path}: unknown section(s) {', '.join(extra)}; only [tuner] is read")
    t = raw.get("tuner", {})
    if not isinstance(t, dict):
        raise TunerConfigError(f"{path}: tuner must be a [tuner] table")
    return dict(t)


def make_config(table: dict, resolve) -> TunerConfig:
    """Levels (a spec string or a list) resolved against the GPUs' ranges by `resolve(knob, spec)` (the
    controller's parser, or the read-only plan in dry-run), then the whole config checked."""
    spec = table.get("levels")
    if spec is None:
        raise TunerConfigError("tuner.levels: give the allowed levels (--levels or levels = ... in [tuner])")
    knob = table.get("knob", "power")
    if knob not in ("power", "clock"):
        raise TunerConfigError("tuner.knob: power or clock")
    if isinstance(spec, list):
        spec = ",".join(str(x) for x in spec)
    return config_from_table(table, resolve(knob, str(spec)), table.get("reference"))
