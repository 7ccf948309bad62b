"""The [tuner] section: read from a TOML file root can trust, levels resolved against the GPUs by the controller."""

from __future__ import annotations

import errno
import math
import os
import sys
import tempfile
from pathlib import Path

from powerprof.control.gpulock import make_dirs
from powerprof.trust import read_trusted, untrusted_folder, untrusted_place
from powerprof.daemon.latency import LATENCY_EDGES_S
from powerprof.paths import state_dir

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
    try:
        data = read_trusted(Path(path), euid=0) if euid == 0 else Path(path).read_bytes()
    except PermissionError as e:
        raise TunerConfigError(f"not using {path}: {e}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TunerConfigError(f"not using {path}: too many levels of symlinks") from None
        raise TunerConfigError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise TunerConfigError(f"{path}: not valid TOML ({e})") from None
    except RecursionError:  # nested past Python's stack: no TOMLDecodeError, and it was a traceback
        raise TunerConfigError(f"{path}: not valid TOML (nested deeper than Python's parser goes)") from None
    extra = sorted(set(raw) - {"tuner"})
    if extra:
        raise TunerConfigError(f"{path}: unknown section(s) {', '.join(extra)}; only [tuner] is read")
    t = raw.get("tuner", {})
    if not isinstance(t, dict):
        raise TunerConfigError(f"{path}: tuner must be a [tuner] table")
    return dict(t)


def gpu_problem(nvml) -> str | None:
    """Why there is no GPU to tune (no driver: NVML cannot start), with the fix; None where NVML answers. Checked
    before the levels are resolved against the GPUs, which died of pynvml's traceback on a machine without one."""
    from powerprof.collectors.gateway import gateway
    from powerprof.collectors.sources import NO_GPU_FIX
    from powerprof.errtext import error_text

    try:
        with gateway(nvml).session():
            return None
    except Exception as e:  # noqa: BLE001 - NVMLError (no library, no driver) or the bindings' own failure
        return f"tune needs a GPU whose power limit it can set: no NVIDIA GPU reachable through NVML ({error_text(e)}); fix: {NO_GPU_FIX}"


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
    reference = table.get("reference")
    if isinstance(reference, bool) or (reference is not None and not isinstance(reference, (int, float, str))):
        raise TunerConfigError("tuner.reference: one of the levels, as a number or in the levels' form (\"80%\")")
    if isinstance(reference, str):  # "80%", "250W": the same parser as the levels
        try:
            (reference,) = resolve(knob, reference)
        except ValueError as e:
            raise TunerConfigError(f"tuner.reference: {e}") from None
    return config_from_table(table, resolve(knob, str(spec)), reference)


# Upper bounds the policy does not set: past them a setting is a typo, and inf would switch a safety off.
MAX_SECONDS = 30 * 86400.0
MAX_RATIO = 10.0
_SECONDS = ("tick_s", "window_s", "dwell_s", "guard_s", "explore_horizon_s", "reprobe_s", "backoff_s", "regime_s",
            "stale_s", "strike_s", "trial_guard_s", "trend_s", "model_memory_s")


def check_bounds(cfg: TunerConfig) -> None:
    """Finite, sane settings for a live run (TunerConfigError naming the key): no infinite tick or stale time, a guard
    that can fire, and stale_s at least two ticks (else every gap between two reads would count as stale)."""
    errs = [f"tuner.{k}: at most {MAX_SECONDS:g} s" for k in _SECONDS
            if not (math.isfinite(getattr(cfg, k)) and getattr(cfg, k) <= MAX_SECONDS)]
    errs += [f"tuner.{k}: at most {MAX_RATIO:g}" for k in ("accept_ratio", "hold_ratio", "guard_ratio")
             if not (math.isfinite(getattr(cfg, k)) and getattr(cfg, k) <= MAX_RATIO)]
    # A p95 past the daemon's top bucket reads as that edge: an SLO whose guard threshold is at or past it never fires.
    top_ms = LATENCY_EDGES_S[-1] * 1000
    errs += [f"tuner.{k}: under {top_ms / cfg.guard_ratio:g} ms (the daemon's latency buckets end at {top_ms:g} ms: "
             "past that no breach can be seen and the guard would never fire)"
             for k in ("tpot_p95_ms", "ttft_p95_ms")
             if getattr(cfg, k) is not None and math.isfinite(cfg.guard_ratio) and getattr(cfg, k) * cfg.guard_ratio >= top_ms]
    # Under the first bucket a p95 cannot be read: every one over it is a breach, and the tuner sits at the reference
    # for ever with nothing said (seconds typed into a milliseconds flag: --tpot-p95-ms 0.1).
    # A p95 with every request in the first bucket reads just under its edge (0.95 ms): an SLO whose accept threshold
    # (accept_ratio × SLO) is under that edge is met by none either.
    low_ms = LATENCY_EDGES_S[0] * 1000 / cfg.accept_ratio if cfg.accept_ratio > 0 else LATENCY_EDGES_S[0] * 1000
    errs += [f"tuner.{k}: at least {low_ms:.3g} ms (the daemon's latency buckets start at 1 ms, and a window is "
             f"accepted under accept_ratio {cfg.accept_ratio:g} × the SLO: below it no window could be; the SLO is in "
             f"milliseconds, {getattr(cfg, k):g} ms given)"
             for k in ("tpot_p95_ms", "ttft_p95_ms") if getattr(cfg, k) is not None and getattr(cfg, k) < low_ms]
    if not errs and cfg.stale_s < 2 * cfg.tick_s:
        errs.append(f"tuner.stale_s ({cfg.stale_s:g}) must be at least two ticks (tick_s {cfg.tick_s:g})")
    if errs:
        raise TunerConfigError("; ".join(errs))


# Under these no real server answers (a network round trip and a prefill; a decode step): an SLO below is most likely
# seconds typed into a milliseconds flag (`--ttft-p95-ms 2` for 2 s), which holds the reference for ever.
IMPLAUSIBLE_MS = {"ttft_p95_ms": 20.0, "tpot_p95_ms": 2.0}


def slo_warnings(cfg: TunerConfig) -> list[str]:
    """What to say of an SLO no real server meets (warned, not refused: a test rig may)."""
    return [f"tuner.{k} = {getattr(cfg, k):g} ms: under {v:g} ms no real server answers, so every window would breach "
            f"it and the tuner hold the reference; is it in seconds? (the SLO is in milliseconds)"
            for k, v in IMPLAUSIBLE_MS.items() if getattr(cfg, k) is not None and getattr(cfg, k) < v]


def check_root_folder(path: Path, what: str, euid: int | None = None) -> None:
    """As root, refuse a folder root will write in (`what` names it) that another user could write, or that has such
    a folder above it: through a symlink planted there, root's next file would land anywhere on the machine. The
    daemon's own data-dir rule (`untrusted_folder`), applied to the nearest folder that exists, so nothing is
    created under a folder that fails it."""
    why = untrusted_place(path, euid)
    if why:
        raise TunerConfigError(f"{what} {path}: refusing to write there as root: {why} (another user could make root "
                               "write any file through it); give root a folder of its own (chown root:, chmod go-w)")


def day_folder_reason(day_dir: Path, euid: int | None = None) -> str | None:
    """Why root must not write in this `date=` folder of --out (None when it may): as root it must be a real folder,
    not a symlink, root's and writable by no one else, as every folder above it (`untrusted_folder`). One that
    already exists may have been planted by another user (before --out was made root's, or dated ahead)."""
    return untrusted_folder(day_dir, euid) if os.path.lexists(day_dir) else untrusted_place(day_dir, euid)


def check_out_dir(path: Path, euid: int | None = None, parents: bool = False) -> None:
    """The decisions folder exists (or is made) and takes a file: found now, not after the reference is set. As
    root, only in a folder no one else could write (`check_root_folder`), holding no `date=` folder root could not
    write in (each is checked again before each write: runner.DecisionLog). `parents`: the folders above it may be
    made too (the default path); a given --out is made only where its parent exists, as the daemon's data dir: a
    mistyped `--out /nonexistent/dir` made that tree, under / as root, where monitor, trace and export refuse it."""
    from powerprof.storage.runs import cwd_gone, missing_parent  # noqa: PLC0415

    if (why := cwd_gone(path)) is not None:  # said first, not as root's "cannot inspect"
        raise TunerConfigError(why)
    check_root_folder(path, "--out", euid)
    if not parents and (why := missing_parent(path)) is not None:  # in every command's words (exit 2)
        raise TunerConfigError(why)
    try:
        make_dirs(Path(path))
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise TunerConfigError(f"--out {path}: cannot write there ({e.strerror or e})") from None
    check_root_folder(path, "--out", euid)  # the folder itself, made now or found
    for day in sorted(Path(path).glob("date=*")):
        why = day_folder_reason(day, euid)
        if why:
            raise TunerConfigError(f"--out {path}: refusing to write in {day.name} as root: {why} (another user could "
                                   "make root write any file through it); remove it, or chown root: and chmod go-w")


def kill_file() -> Path:
    """Where SIGUSR1's kill switch is persisted (the tuner's state folder, root's when root runs it)."""
    return state_dir() / "tuner-killed"
