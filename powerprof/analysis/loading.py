"""Reading run directories for analysis: metadata, pooled windows, and what the samples say per level.

Several runs (or repeats) of the same GPU model and count, server, traffic, request settings and energy
method pool their windows; runs that differ in any are refused unless forced, because their levels are not comparable.
samples.parquet is scanned by DuckDB (engine.py) within a memory limit, so 100 M rows never sit in memory at once.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from powerprof import termination
from powerprof.storage import datafiles
from powerprof.storage.runs import RUN_JSON, no_finished_level
from powerprof.storage.schema import LEVELS

from . import engine
from .rowkeys import window_key

TIMELINE_BINS = 1500  # points per device in the power/clock plot: enough for a page-wide figure
# The key under which RunWriter copies run.json into every Parquet file's footer (storage/runs.py).
FOOTER_META_KEY = b"powerprof"


class AnalysisError(ValueError):
    """Bad input to the analysis: the message says what and how to fix it."""


@dataclass(frozen=True)
class RunInfo:
    path: Path
    run_id: str
    gpu_name: str | None
    gpu_uuid: str | None
    model: str | None
    min_limit_w: float | None
    max_limit_w: float | None
    default_limit_w: float | None
    simulated: bool
    meta: dict = field(default_factory=dict, repr=False)
    gpu_count: int | None = None  # GPUs whose energy the windows sum (run.json `gpus`); None: unknown
    has_meta: bool = True  # run.json was there: without it nothing says what the run measured with
    # Where `meta` came from: "run.json", FOOTER_META_KEY's copy in windows.parquet (run.json missing), or None (neither).
    meta_from: str | None = "run.json"


def _get(meta: dict, *paths, default=None):
    """First present value among dotted paths (`gpu.name`, `gpus.0.name`): writers nest differently."""
    for p in paths:
        cur = meta
        for part in p.split("."):
            if isinstance(cur, dict) and part in cur:
                cur = cur[part]
            elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
                cur = cur[int(part)]
            else:
                cur = None
                break
        if cur is not None:
            return cur
    return default


def _float(x) -> float | None:
    try:
        return None if x is None else float(x)
    except (TypeError, ValueError):
        return None


def read_run_info(run_dir) -> RunInfo:
    path = Path(run_dir)
    if path.is_file():
        raise AnalysisError(f"{path} is a file, not a run directory: give the folder that holds windows.parquet "
                            "(a sweep's run), or a daemon data folder (requests/, intervals/)")
    if not path.is_dir():
        raise AnalysisError(f"{path}: no such run directory")
    meta_path = path / RUN_JSON
    meta: dict = {}
    if meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise AnalysisError(f"{meta_path}: not valid JSON ({e})") from None
        except RecursionError:  # nested past Python's stack: no ValueError, and it was a traceback
            raise AnalysisError(f"{meta_path}: not valid JSON (nested deeper than Python's parser goes)") from None
        except (OSError, UnicodeDecodeError) as e:  # a folder by that name, bytes that are no text: was a traceback
            why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else (e.strerror or str(e))
            raise AnalysisError(f"{meta_path}: cannot be read ({why}); a sweep writes it as JSON with the run's GPU and "
                                "settings: restore it, or move it aside to analyse the windows alone") from None
        if not isinstance(meta, dict):
            raise AnalysisError(f"{meta_path}: not a JSON object (it holds a {type(meta).__name__}); a sweep writes "
                                "one with the run's GPU and settings: restore it, or move it aside to analyse the "
                                "windows alone")
        _check_meta_types(meta_path, meta)
    if not (path / "windows.parquet").exists():
        # The folder of runs (`analyze runs`) said only "windows.parquet is missing": name the runs it holds.
        inner = sorted(p.name for p in path.iterdir() if (p / "windows.parquet").exists()) if path.is_dir() else []
        hint = ("; it holds run directories: give one of them (" + ", ".join(str(path / n) for n in inner[-3:][::-1])
                + (", ..." if len(inner) > 3 else "") + f"), or several as a glob ({path}/*)") if inner else ""
        raise AnalysisError(no_finished_level(path) or _daemon_dataset_hint(path)
                            or f"{path} is not a powerprof run directory: windows.parquet is missing{hint}")
    meta_from = "run.json" if meta_path.exists() else None
    if meta_from is None:
        # A copy without run.json was analysed as a real card's (no "simulated" banner) and advised levels below the
        # card's minimum: every Parquet file carries run.json as it was when the file was written.
        meta = _footer_meta(path / "windows.parquet")
        try:
            _check_meta_types(path / "windows.parquet", meta)
        except AnalysisError:
            # Its fix (restore run.json, or move it aside) cannot be followed here: analysed without, as before the
            # footer was read, and said (no_run_json_findings).
            meta = {}
        if meta:
            meta_from = "windows.parquet"
    model = _get(meta, "model", "server.model", "server.model_path", "workload.model")
    if model is None:
        model = _windows_model(path / "windows.parquet")
    return RunInfo(
        path=path,
        run_id=str(_get(meta, "run_id", default=path.name)),
        gpu_name=_get(meta, "gpu_name", "gpu.name", "gpus.0.name"),
        gpu_uuid=_get(meta, "gpu_uuid", "gpu.uuid", "gpus.0.uuid"),
        model=None if model is None else Path(str(model)).name,
        min_limit_w=_float(_get(meta, "min_limit_w", "limits.min_w", "gpu.min_limit_w", "gpus.0.min_limit_w")),
        max_limit_w=_float(_get(meta, "max_limit_w", "limits.max_w", "gpu.max_limit_w", "gpus.0.max_limit_w")),
        default_limit_w=_float(
            _get(meta, "default_limit_w", "limits.default_w", "gpu.default_limit_w", "gpus.0.default_limit_w")
        ),
        simulated=bool(_get(meta, "simulated", default=False)),
        meta=meta,
        gpu_count=_gpu_count(meta),
        has_meta=meta_path.exists(),
        meta_from=meta_from,
    )


def _footer_meta(windows_path: Path) -> dict:
    """run.json's copy in a Parquet file's footer (RunWriter writes one into each); {} where there is none or it
    cannot be read (the analysis then goes on without, and says so)."""
    try:
        raw = (pq.read_schema(windows_path).metadata or {}).get(FOOTER_META_KEY)
        meta = json.loads(raw) if raw else {}
    except (pa.ArrowInvalid, OSError, ValueError, RecursionError):  # RecursionError: JSON nested past Python's stack
        return {}
    return meta if isinstance(meta, dict) else {}


def _what(v) -> str:
    """How a refusal names a JSON value's kind: "a string", "an object", "null"."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"{str(v).lower()} (a boolean)"
    if isinstance(v, (int, float)):
        return "a number too large for a float" if isinstance(v, int) else f"{v} (not finite)"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def _is_number(v, finite: bool = True) -> bool:
    """A JSON number a float holds (an int past 1e308 overflowed float()), finite unless told; true/false are not."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        f = float(v)
    except OverflowError:
        return False
    return not finite or f == f and abs(f) != float("inf")


def _check_meta_types(meta_path: Path, meta: dict) -> None:
    """run.json's fields the analysis reads, of the kind a sweep writes them, checked once here so that every reader
    gets sane values or this one line: `"settings": "x"` was an AttributeError in the report, `"idle_gpu_power_w":
    "x"` a TypeError in the timeline plot, `levels_done` `[[[1], 0]]` a TypeError, `settings.levels` `[1e400]` (as
    an int) an OverflowError, and `[["zz", 0]]` "could not convert string to float: 'zz'" naming no field. An absent
    field or null stays what it was (unknown)."""
    def refuse(field: str, v, want: str):
        raise AnalysisError(f"{meta_path}: {field} is {_what(v)}, not {want}; a sweep writes it as {want}: restore "
                            "run.json, or move it aside to analyse the windows alone")

    def number(field, v, finite=True):
        if v is not None and not _is_number(v, finite):
            refuse(field, v, "a number")

    for key in ("settings", "params", "server", "trace", "prompt_set", "idle_gpu_power_w_by_gpu"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            refuse(key, meta[key], "an object")
    for key in ("gpus", "levels_done", "server_restarts"):
        if meta.get(key) is not None and not isinstance(meta[key], list):
            refuse(key, meta[key], "a list")
    for key in ("run_id", "idle_baseline_note", "unstored_error"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            refuse(key, meta[key], "a string")
    # Not finite is allowed where a reader checks it (a NaN baseline is drawn as none); too large for a float is not.
    number("idle_gpu_power_w", meta.get("idle_gpu_power_w"), finite=False)
    for key in ("min_limit_w", "max_limit_w", "default_limit_w"):
        number(key, meta.get(key), finite=False)
    for gpu, w in (meta.get("idle_gpu_power_w_by_gpu") or {}).items():
        number(f"idle_gpu_power_w_by_gpu.{gpu}", w, finite=False)
    for i, g in enumerate(meta.get("gpus") or []):
        if not isinstance(g, dict):
            refuse(f"gpus[{i}]", g, "an object")
        for key in ("min_limit_w", "max_limit_w", "default_limit_w"):
            number(f"gpus[{i}].{key}", g.get(key), finite=False)
    st = meta.get("settings") or {}
    if st.get("level_kind") is not None and not isinstance(st["level_kind"], str):
        refuse("settings.level_kind", st["level_kind"], "a string")
    if st.get("repeats") is not None and (isinstance(st["repeats"], bool) or not isinstance(st["repeats"], int)):
        refuse("settings.repeats", st["repeats"], "a whole number")
    for key in ("target_ci", "max_time_s", "max_requests"):
        number(f"settings.{key}", st.get(key))
    if st.get("levels") is not None:
        if not isinstance(st["levels"], list):
            refuse("settings.levels", st["levels"], "a list")
        for i, v in enumerate(st["levels"]):
            number(f"settings.levels[{i}]", v)
    for i, d in enumerate(meta.get("levels_done") or []):
        if not isinstance(d, list) or len(d) not in (2, 4):
            refuse(f"levels_done[{i}]", d, "a list of [level, repeat] (a grid's: [level, repeat, config, context])")
        number(f"levels_done[{i}][0] (the level)", d[0])
        if d[1] is not None and (isinstance(d[1], bool) or not isinstance(d[1], int)):
            refuse(f"levels_done[{i}][1] (the repeat)", d[1], "a whole number")
        if len(d) == 4:
            if d[2] is not None and not isinstance(d[2], str):
                refuse(f"levels_done[{i}][2] (the configuration)", d[2], "a string")
            number(f"levels_done[{i}][3] (the context tokens)", d[3])


def _daemon_dataset_hint(path: Path) -> str | None:
    """What to say of a daemon dataset, or a folder inside one, given where a sweep's run was expected: `analyze
    DIR/requests` said "windows.parquet is missing", and a dataset beside sweep runs the same. None: neither."""
    from powerprof.storage.schema import DAEMON_DATASETS

    from .fleet import fleet_folder_refusal, is_daemon_dataset

    if is_daemon_dataset(str(path)):
        return (f"{path} is a daemon dataset, not a sweep's run: analyze it on its own (powerprof analyze {path}: "
                "the per-host summary), and the sweep runs apart")
    # One of its tables (requests/), or a partition in one (requests/date=...): the dataset is a level or two up.
    for root in list(path.parents)[:3]:
        inside = path.relative_to(root).parts
        if inside[0] in DAEMON_DATASETS and is_daemon_dataset(str(root)):
            return (f"{path} is inside the daemon dataset {root} (its {inside[0]}/ table), not a sweep's run: give "
                    f"the dataset folder: powerprof analyze {root} (the per-host summary; powerprof export {root} "
                    "--format csv for its rows)")
    # A fleet's folder, one dataset per node in it (docs/fleet.md): "windows.parquet is missing" told nothing.
    return fleet_folder_refusal(path, "analyze")


def _gpu_count(meta: dict) -> int | None:
    gpus = meta.get("gpus")
    if isinstance(gpus, list) and gpus:
        return len(gpus)
    n = meta.get("gpu_count")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def file_digest(path: Path) -> str | None:
    """sha256 of a file's bytes; None when it cannot be read."""
    import hashlib  # noqa: PLC0415

    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest() if hasattr(hashlib, "file_digest") else \
                hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def run_key(run: RunInfo) -> tuple:
    """What makes two run directories one run: its run_id and the very same windows. A copy of a run pooled
    with itself counts every window twice (analyze refuses it); exported, every row twice (export writes it once)."""
    return run.run_id, file_digest(run.path / "windows.parquet")


def _windows_model(path: Path) -> str | None:
    try:
        t = pq.read_table(path, columns=["model"])
    except (pa.ArrowInvalid, KeyError, OSError):
        return None
    vals = [v for v in pc.unique(t.column("model")).to_pylist() if v]
    return vals[0] if len(vals) == 1 else None


# Request settings (run.json `params`) that change what a token costs: another decode length, EOS honoured
# or not (shorter replies), a prompt cache (no prefill), sampling.
REQUEST_SETTINGS = ("max_tokens", "ignore_eos", "prompt_cache", "temperature")


def check_compatible(runs: list[RunInfo], force: bool = False) -> list[str]:
    """Refuse to pool runs that measured different things: GPU model or count, server model, engine, build or slots,
    traffic (trace or prompt set), request settings, energy method, or a run whose run.json is missing
    (nothing to check it by); with `force`, pool them and return what differs (one sentence each), for
    the caller to warn with wherever it reports. A value one run does not record is not compared."""
    if len(runs) < 2:
        return []
    differs = []
    blind = [r for r in runs if not r.has_meta and not r.meta_from]
    if blind:
        differs.append(f"{', '.join(str(r.path) for r in blind)} {'has' if len(blind) == 1 else 'have'} no run.json: "
                       "its GPU, GPU count and settings are unknown, so nothing could tell it from another card's run")
    # Read from the footer instead, the facts are compared below as run.json's would be; still not pooled unasked, since
    # a run.json missing is a copy made by hand, and what else it left out nothing says.
    footed = [r for r in runs if not r.has_meta and r.meta_from]
    if footed:
        differs.append(f"{', '.join(str(r.path) for r in footed)} {'has' if len(footed) == 1 else 'have'} no run.json: "
                       "its GPU, GPU count and settings are read from windows.parquet's footer metadata (compared "
                       "below), not from the run's own record")
    facts = {r.path: _window_facts(r) for r in runs}

    def compare(what: str, value) -> None:
        seen = {r.path: value(r) for r in runs}
        if len({v for v in seen.values() if v is not None}) > 1:
            detail = "; ".join(f"{p}: {'unknown' if v is None else v}" for p, v in seen.items())
            differs.append(f"runs differ in {what} ({detail})")

    compare("GPU model", lambda r: r.gpu_name)
    compare("GPU count", lambda r: r.gpu_count)
    compare("server model", lambda r: r.model)
    compare("server engine", lambda r: facts[r.path].get("server"))
    # Another build of one engine can decode at another speed; other slots (-np) batch otherwise.
    compare("server build", lambda r: _server(r).get("build_info"))
    compare("server slots", lambda r: _server(r).get("total_slots"))
    traffic = {r.path: (r.meta.get("trace") or {}).get("sha256", "the prompt set") for r in runs}
    if len(set(traffic.values())) > 1:
        detail = "; ".join(f"{p}: {'trace ' + t[:12] if t != 'the prompt set' else t}" for p, t in traffic.items())
        differs.append(f"runs differ in traffic ({detail})")
    elif (d := _prompt_set_hash_differs(runs) or _prompt_set_differs(runs, facts)) is not None:
        differs.append(d)
    for key in REQUEST_SETTINGS:
        compare(key, lambda r: (r.meta.get("params") or {}).get(key) if isinstance(r.meta.get("params"), dict) else None)
    compare("energy method", lambda r: facts[r.path].get("energy_method"))
    if differs and not force:
        why = ("a trace replay's J/token is not comparable with another traffic's" if "traffic" in differs[0]
               else "their levels are not comparable")
        raise AnalysisError(f"{'; '.join(differs)}: {why}. Analyse them separately, or pass --force to pool them anyway.")
    return differs


def _server(run: RunInfo) -> dict:
    return run.meta["server"] if isinstance(run.meta.get("server"), dict) else {}


def _window_facts(run: RunInfo) -> dict:
    """What a run's own windows say it measured with: `server` (engine), `energy_method` (the most common
    among its measured windows), `prompts` ({(prompt_id, context_tokens): {prompt_tokens}}). Empty when the
    file cannot be read (read_windows says why)."""
    path = run.path / "windows.parquet"
    want = ("server_kind", "energy_method", "prompt_id", "prompt_tokens", "context_tokens", "warmup", "status")
    try:
        names = set(pq.read_schema(path).names)
        t = pq.read_table(path, columns=[c for c in want if c in names])
    except (pa.ArrowInvalid, OSError):
        return {}
    rows = [r for r in t.to_pylist() if not r.get("warmup") and r.get("status") in (None, "ok")]
    out: dict = {}
    kinds = sorted({r["server_kind"] for r in rows if r.get("server_kind")})
    out["server"] = "+".join(kinds) or None
    methods = [r["energy_method"] for r in rows if r.get("energy_method") not in (None, "none")]
    out["energy_method"] = max(sorted(set(methods)), key=methods.count) if methods else None
    prompts: dict[tuple, set] = {}
    for r in rows:
        if r.get("prompt_id") is not None:
            tokens = prompts.setdefault((r["prompt_id"], r.get("context_tokens")), set())
            if r.get("prompt_tokens") is not None:
                tokens.add(r["prompt_tokens"])
    out["prompts"] = prompts
    return out


def _prompt_set_hash(run: RunInfo) -> str | None:
    ps = run.meta.get("prompt_set")
    sha = ps.get("sha256") if isinstance(ps, dict) else None
    return sha if isinstance(sha, str) and sha else None


def _prompt_set_hash_differs(runs: list[RunInfo]) -> str | None:
    """Whether runs whose run.json names its prompt set (`prompt_set.sha256`) sent other sets: the texts
    themselves, where the windows only show ids and lengths."""
    seen = {r.path: _prompt_set_hash(r) for r in runs}
    if len({v for v in seen.values() if v is not None}) < 2:
        return None
    detail = "; ".join(f"{p}: {'not recorded' if v is None else 'sha256 ' + v[:12]}" for p, v in seen.items())
    return f"runs differ in prompt set ({detail})"


def _prompt_set_differs(runs: list[RunInfo], facts: dict) -> str | None:
    """Whether two runs sent other prompts, from their windows, for a pair where one run.json does not name
    its prompt set (older runs; both named: _prompt_set_hash_differs decides): neither's prompt ids within the
    other's (a run cut short measured part of the set), or one id with other prompt lengths (line-1 of two
    --prompts files). None when they agree or a run has no prompt ids."""
    with_ids = [r for r in runs if facts[r.path].get("prompts")]
    for i, a in enumerate(with_ids):
        for b in with_ids[i + 1:]:
            if _prompt_set_hash(a) is not None and _prompt_set_hash(b) is not None:
                continue  # the same hash: the same texts in the same order
            pa_, pb = facts[a.path]["prompts"], facts[b.path]["prompts"]
            if not (pa_.keys() <= pb.keys() or pb.keys() <= pa_.keys()):
                def names(p):
                    ids = sorted({k[0] for k in p})
                    return ", ".join(ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")
                return f"runs differ in prompt set (prompt ids {a.path}: {names(pa_)}; {b.path}: {names(pb)})"
            for k in sorted(pa_.keys() & pb.keys(), key=str):
                if pa_[k] and pb[k] and not pa_[k] & pb[k]:
                    return (f"runs differ in prompt set (prompt {k[0]}: {'/'.join(map(str, sorted(pa_[k])))} prompt tokens "
                            f"in {a.path}, {'/'.join(map(str, sorted(pb[k])))} in {b.path})")
    return None


def same_run(run: RunInfo) -> tuple:
    """What makes two run directories hold one run, for export: the run_id its run.json records (sweep.py draws
    one per run), whatever the bytes of its files (a copy whose windows.parquet was joined to itself is still
    that run); without one, run_key."""
    rid = run.meta.get("run_id")
    return ("run_id", str(rid)) if rid not in (None, "") else run_key(run)


def read_windows(runs: list[RunInfo], twice: dict | None = None) -> pa.Table:
    """Windows of every run, one table (columns of the WINDOWS schema that each file has). A window stored
    twice in one file (rowkeys.WINDOW_KEY) is kept once: `twice` (when given) receives {file: rows left out}.
    A window in two runs' files is the same run given twice (a copy whose files differ in bytes): refused."""
    tables = []
    for r in runs:
        try:
            t = pq.read_table(r.path / "windows.parquet")
        except (pa.ArrowInvalid, OSError) as e:
            raise AnalysisError(f"{r.path / 'windows.parquet'}: cannot be read as Parquet ({e})") from None
        # The rule export reads a table by (storage/datafiles.py): warmup as text died here with ArrowTypeError.
        if why := datafiles.type_refusal("windows", [(r.path / "windows.parquet", t.schema)]):
            raise AnalysisError(why)
        if why := _untold_windows(t):
            raise AnalysisError(f"{r.path / 'windows.parquet'}: {why}; powerprof writes warmup, status and energy_method "
                                "in every window row (another tool's file or an edited one): restore them, or the file "
                                "from the run, and rerun")
        if "run_id" not in t.column_names or t.column("run_id").null_count == t.num_rows:
            t = _set_column(t, "run_id", pa.array([r.run_id] * t.num_rows, pa.string()))
        _refuse_other_runs(r, t)
        _refuse_unlevelled(r.path / "windows.parquet", t)
        t, n = _once_each(t)
        if n and twice is not None:
            twice[r.path / "windows.parquet"] = n
        tables.append(t.replace_schema_metadata(None))
    out = pa.concat_tables(tables, promote_options="permissive")
    _refuse_shared_windows(runs, [t.num_rows for t in tables], out)
    missing = {"level_value", "decode_tok_s"} - set(out.column_names)
    if missing:
        raise AnalysisError(f"windows.parquet lacks the columns {sorted(missing)}: not a powerprof sweep run")
    return out


def _untold_windows(t: pa.Table) -> str | None:
    """Why which windows count, or how their energy was measured, cannot be told from `t`; None where it can.
    Which windows count rests on warmup and status: read as missing, every window was warm-up (or failed), and the
    error blamed that instead of the file; a null one was read as measured (warmup false, status ok), 2 warm-up windows
    a level counted unflagged (180 W: n 8 → 10, 2.4790 → 2.4848 J/token). Without energy_method the level's method
    was a NaN, and the analysis died on it with a traceback."""
    if not t.num_rows:
        return None
    lacking = [c for c in ("warmup", "status") if c not in t.column_names]
    if lacking:
        return (f"no {' and no '.join(lacking)} column, so which windows are warm-up or failed cannot be told")
    nulls = [(c, t.column(c).null_count) for c in ("warmup", "status") if t.column(c).null_count]
    if nulls:
        return " and ".join(f"{n} of {t.num_rows} rows have no {c} value (null), so whether those windows are "
                            f"{'warm-up' if c == 'warmup' else 'failed'} cannot be told" for c, n in nulls)
    if "energy_method" not in t.column_names:
        return ("no energy_method column, so how each window's energy was measured (an energy counter, power "
                "integration, or none) cannot be told, nor the flags that rest on it")
    return None


def _refuse_other_runs(r: RunInfo, t: pa.Table) -> None:
    """AnalysisError for window rows of another run than the folder's (its run.json's run_id): a folder holds one run.
    One windows.parquet holding every window twice, the copy under a second run_id, escaped the check for a window
    stored twice (the key holds run_id): n 8 → 16 a level, its CI half as wide (300 W: 3.174-3.429 → 3.249-3.345)."""
    rid = r.meta.get("run_id")
    if rid in (None, "") or not t.num_rows:
        return
    ids = t.column("run_id")
    other = pc.and_(pc.is_valid(ids), pc.not_equal(ids, str(rid)).fill_null(True))
    n = pc.sum(other).as_py() or 0
    if n:
        first = ids.filter(other)[0].as_py()
        raise AnalysisError(f"{r.path / 'windows.parquet'}: {n} of {t.num_rows} windows have run_id {first!r}, not this "
                            f"run's ({str(rid)!r}, from its {r.meta_from or 'run.json'}): a run folder holds one run (a windows.parquet joined "
                            "with another run's or its own copy, an edited file); counted, they would pass as this run's "
                            "windows, a window twice. Restore the file from the run, or give each run its own folder")


def _refuse_unlevelled(path, t: pa.Table) -> None:
    """AnalysisError for windows whose level_value is NaN, infinite, zero or negative, whatever their level_kind: no
    level is, so no level's figures could hold them, and leaving them out would drop them unsaid (pandas and numpy
    drop NaN keys; DuckDB and Arrow would group them as one NaN level); analysed, a negated column recommended
    "-180 W", exit 0 (with level_kind none or null too). powerprof writes a level as a positive number, and the
    settings as they are (level_kind none) as null; anything else comes from another tool or an edit."""
    if "level_value" not in t.column_names or "level_kind" not in t.column_names or not t.num_rows:
        return
    values = np.asarray(t.column("level_value").to_numpy(zero_copy_only=False), dtype=float)
    kinds = t.column("level_kind").to_pylist()
    bad: dict[tuple, int] = {}
    for k, v, null in zip(kinds, values, t.column("level_value").is_null().to_pylist()):
        if not null and not (np.isfinite(v) and v > 0):
            bad[(k, "NaN" if v != v else f"{v:g}")] = bad.get((k, "NaN" if v != v else f"{v:g}"), 0) + 1
    if bad:
        which = "; ".join(f"{n} windows at level_kind {k} have level_value {v}" for (k, v), n in bad.items())
        raise AnalysisError(f"{path}: {which}: a level no setting is, so no level's figures can hold them (another "
                            "tool's rows or an edited file: powerprof writes each level as a positive number, and the settings "
                            "as they are as null); nothing was analysed. Fix or remove those rows and rerun "
                            "(`powerprof export` writes them, NaN marked as NaN)")


def _refuse_shared_windows(runs: list[RunInfo], rows: list[int], windows: pa.Table) -> None:
    """AnalysisError when a window (rowkeys.WINDOW_KEY, run_id included) is in two runs' files: one run given twice,
    whose files differ so run_key did not match (a windows.parquet joined to itself, an edited copy). Pooled, its
    windows and samples counted twice and every confidence interval was too narrow."""
    key = window_key(windows.column_names)
    if len(runs) < 2 or key is None or not windows.num_rows:
        return
    which = np.repeat(np.arange(len(runs)), rows)
    g = (windows.select(list(key)).append_column("__run", pa.array(which))
         .group_by(list(key), use_threads=False).aggregate([("__run", "min"), ("__run", "max")]))
    shared = pc.not_equal(g.column("__run_min"), g.column("__run_max"))
    n = pc.sum(shared).as_py() or 0
    if not n:
        return
    first = g.filter(shared).slice(0, 1).to_pylist()[0]
    a, b = runs[first["__run_min"]], runs[first["__run_max"]]
    rid = first.get("run_id") or a.run_id
    raise AnalysisError(f"{a.path} and {b.path} hold the same run (run_id {rid}): {n} windows are in both, though "
                        "their files differ (a windows.parquet joined to itself, an edited copy); pooled, its "
                        "windows and samples would count twice and every confidence interval be too narrow; give it "
                        "once (the copy you trust)")


def _once_each(t: pa.Table) -> tuple[pa.Table, int]:
    """The table with each window once (its first row of rowkeys.WINDOW_KEY), and how many rows were left out. Counted
    twice, a window narrows every CI as a run given twice did (two files concatenated, a writer run twice)."""
    key = window_key(t.column_names)
    if not t.num_rows or key is None:
        return t, 0  # nothing that names a window: no two rows can be told to be one
    key = list(key)
    idx = "__row"
    first = (t.select(key).append_column(idx, pa.array(np.arange(t.num_rows)))
             .group_by(key, use_threads=False).aggregate([(idx, "min")]).column(f"{idx}_min"))
    if len(first) == t.num_rows:
        return t, 0
    return t.take(pc.take(first, pc.sort_indices(first))), t.num_rows - len(first)  # in the file's order


def _set_column(t: pa.Table, name: str, arr: pa.Array) -> pa.Table:
    if name in t.column_names:
        return t.set_column(t.column_names.index(name), name, arr)
    return t.append_column(name, arr)


# --- what the samples say ---------------------------------------------------------------------

SAMPLE_LEVEL_COLUMNS = ("enforced_limit_w", "avg_cpu_power_w", "sm_clock_mhz", "mem_clock_mhz", "cap_not_engaged",
                        "cap_not_engaged_gpus", "thermal_throttle",
                        "no_busy_clock")  # not a levels column: the flag no-busy-reading (stats.NO_BUSY_FLAG)
# What only the sweep knows about a level, carried from levels.parquet into the analysis.
SWEEP_LEVEL_COLUMNS = SAMPLE_LEVEL_COLUMNS + ("stop_rule", "draft_n", "draft_n_accepted", "draft_acceptance", "draft_source",
                                              "counter_refresh_s")
# Pooled over runs by their largest: a slower refresh needs longer windows (analysis.stats short-windows).
MAX_LEVEL_COLUMNS = ("counter_refresh_s",)
SUMMED_LEVEL_COLUMNS = ("draft_n", "draft_n_accepted")  # pooled over runs by their sum, not their mean


@dataclass
class Timeline:
    """Power and SM clock binned over a run's time, per GPU device, for the plot."""

    run_id: str
    t_s: np.ndarray  # (bins,) bin centres, seconds since the first sample
    devices: tuple[str, ...]
    power_w: np.ndarray  # (devices, bins), NaN where a bin has no sample
    sm_clock_mhz: np.ndarray
    level_value: np.ndarray  # (bins,) the level the bin belongs to (last seen), NaN outside levels
    # The run's directory, which finds its run.json: one per run (analyze takes each once), where run_id may be two
    # runs' (pooled with --force). None only for a timeline made by hand (plots.plot_timeline alone).
    path: Path | None = None


def scan_samples(run: RunInfo, windows: pa.Table | None = None, bins: int = TIMELINE_BINS,
                 con=None) -> tuple[dict, Timeline | None]:
    """What the samples say per level inside the run's measured decode windows, and a binned timeline.

    Returns ({(level_kind, level_value): engine.LevelSums}, Timeline or None without samples);
    pool the sums over runs, then engine.level_figures. DuckDB does the scans out of core (engine.py).
    """
    path = run.path / "samples.parquet"
    if not path.exists():
        return {}, None
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise AnalysisError(f"{path}: cannot be read as Parquet ({e})") from None
    # As export refuses it (storage/datafiles.py): DuckDB failed on power_w as text, said as a damaged file.
    if why := datafiles.type_refusal("samples", [(path, schema)]):
        raise AnalysisError(why)
    names = set(schema.names)
    if "t_mono_s" not in names:
        return {}, None
    if con is None:
        with engine.connect() as c:
            return scan_samples(run, windows, bins, c)
    import duckdb  # noqa: PLC0415  (its error class: engine.py imports it lazily too)

    starts, ends = _measured_intervals_us(windows, run.run_id)
    try:
        rel = engine.samples_relation(con, path)
        # Without measured windows (a run stopped early) every tagged sample counts, as before.
        sums, tb = engine.scan(con, rel, (starts, ends) if starts.size else None, bins=bins,
                               max_power_w=highest_limit_w(run))
    except duckdb.Error as e:  # a footer that opens over damaged pages
        if (stop := termination.exit_inside(e)) is not None:
            raise stop from None
        raise AnalysisError(f"{path}: cannot be read as Parquet ({str(e).strip()}); move it aside to analyse "
                            "the windows without the sensor figures") from None
    if tb is None:
        return sums, None
    tl = Timeline(
        run_id=run.run_id,
        t_s=(np.arange(tb["bins"]) + 0.5) * tb["width"],
        devices=tb["devices"],
        power_w=tb["power_w"],
        sm_clock_mhz=tb["sm_clock_mhz"],
        level_value=tb["level_value"],
        path=run.path,
    )
    return sums, tl


def highest_limit_w(run: RunInfo) -> float | None:
    """The highest power limit of any of the run's GPUs (run.json gpus[].max_limit_w, and max_limit_w), the bound of
    engine.PLAUSIBLE_POWER_FACTOR: RunInfo.max_limit_w is GPU 0's alone, and on a mixed host whose GPU 0 is the
    smaller card (an L4, 72 W) the other card's every reading over 144 W was left out as implausible."""
    gpus = run.meta.get("gpus") if isinstance(run.meta, dict) else None
    highs = [_float(g.get("max_limit_w")) for g in gpus if isinstance(g, dict)] if isinstance(gpus, list) else []
    highs = [h for h in (*highs, run.max_limit_w) if h is not None and math.isfinite(h) and h > 0]
    return max(highs) if highs else None


def sample_level_figures(runs: list[RunInfo], windows: pa.Table | None,
                         implausible: dict | None = None) -> tuple[dict, list[Timeline]]:
    """Per-level sensor figures pooled over the runs' samples (sums added, then divided once),
    and one timeline per run that has samples. implausible (when given) receives, per samples file with readings
    left out as implausible (engine.PLAUSIBLE_POWER_FACTOR), {"max_limit_w", "levels": {(kind, value): LevelSums}}."""
    pooled: dict[tuple, engine.LevelSums] = {}
    timelines = []
    with engine.connect() as con:
        for r in runs:
            sums, tl = scan_samples(r, windows, con=con)
            if tl is not None:
                timelines.append(tl)
            # Samples carry no concurrency: the run's own (one per sweep) keys them, so a run at concurrency 4 pooled
            # with one at 1 keeps its own clocks and flags (they were averaged and OR-ed into both series).
            conc = run_concurrency(r, windows)
            for (kind, value), s in sums.items():
                pooled.setdefault((kind, value, conc), engine.LevelSums()).add(s)
            if implausible is not None and any(s.power_bad_n or s.clock_bad_n for s in sums.values()):
                implausible[r.path / "samples.parquet"] = {"max_limit_w": highest_limit_w(r), "levels": sums}
    return engine.level_figures(pooled), timelines


def run_concurrency(run: RunInfo, windows: pa.Table | None) -> int | None:
    """The one concurrency of the run's windows (a sweep runs one), 1 where they say none; None where they hold
    several (a figure from its samples then belongs to no one series: stats.level_extra falls back to it)."""
    if windows is None or windows.num_rows == 0:
        return 1
    mine = windows
    if "run_id" in windows.column_names:
        mine = windows.filter(pc.equal(windows.column("run_id"), run.run_id).fill_null(False))
    if "concurrency" not in mine.column_names or mine.num_rows == 0:
        return 1
    c = {int(x) if x is not None and x >= 1 else 1 for x in mine.column("concurrency").to_pylist()}
    return c.pop() if len(c) == 1 else None


def _measured_intervals_us(windows: pa.Table | None, run_id: str) -> tuple[np.ndarray, np.ndarray]:
    """Merged [t_first, t_last] spans of the run's measured windows, in µs since the epoch, sorted."""
    from .stats import window_masks  # noqa: PLC0415  (stats imports nothing from here; keep the graph one-way)

    if windows is None or "t_first_utc" not in windows.column_names:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    measured = window_masks(windows)[0]
    if "run_id" in windows.column_names:
        measured &= pc.equal(windows.column("run_id"), run_id).fill_null(False).to_numpy(zero_copy_only=False)
    sub = windows.filter(pa.array(measured))
    s = pc.cast(sub.column("t_first_utc"), pa.int64()).to_numpy(zero_copy_only=False)
    e = pc.cast(sub.column("t_last_utc"), pa.int64()).to_numpy(zero_copy_only=False)
    ok = (s > 0) & (e >= s) if s.size else np.zeros(0, bool)
    return engine.merge_intervals(s[ok], e[ok])


def _pool(v: list):
    if isinstance(v[0], bool):
        return any(v)
    if isinstance(v[0], str):
        return ",".join(dict.fromkeys(x for s in v for x in s.split(",") if x))
    return float(np.mean(v))


def sweep_level_figures(runs: list[RunInfo], where: dict | None = None) -> dict:
    """The sensor columns the sweep already wrote to levels.parquet, pooled over runs:
    numbers averaged, flags OR-ed, strings (stop_rule) joined once each.
    {(level_kind, level_value, concurrency): {column: value}}: a level at another concurrency is another level
    (runs at concurrency 1 and 4 pooled had one draft_n, the sum of both, and one clock). where: only rows with
    these values (one configuration of a configuration sweep: {"config_id": ..., "context_tokens": ...})."""
    pooled: dict[tuple, dict[str, list]] = {}
    for r in runs:
        p = r.path / "levels.parquet"
        if not p.exists():
            continue
        try:
            t = pq.read_table(p)
        except (pa.ArrowInvalid, OSError) as e:
            raise AnalysisError(f"{p}: cannot be read as Parquet ({e})") from None
        # As export refuses it (storage/datafiles.py), as windows and samples are: cap_not_engaged as text was "Could
        # not convert 'false' ...", naming no file; a number as a flag would have pooled as one.
        if why := datafiles.type_refusal("levels", [(p, t.schema)]):
            raise AnalysisError(why)
        cols = [c for c in SWEEP_LEVEL_COLUMNS if c in t.column_names and c in LEVELS.names]
        keys = tuple(where or ())
        for row in t.select([c for c in ("level_kind", "level_value", "concurrency", *keys, *cols)
                             if c in t.column_names]).to_pylist():
            if any(row.get(k) != v for k, v in (where or {}).items()):
                continue
            conc = row.get("concurrency")
            d = pooled.setdefault((row.get("level_kind"), row.get("level_value"),
                                   int(conc) if conc is not None and conc >= 1 else 1), {})
            for c in cols:
                if row.get(c) is not None:
                    d.setdefault(c, []).append(row[c])
    out = {}
    for key, d in pooled.items():
        out[key] = {c: max(v) if c in MAX_LEVEL_COLUMNS else _pool(v) for c, v in d.items()
                    if c not in SUMMED_LEVEL_COLUMNS}
        # Counts over the level's measured requests add up over runs (averaged, 1000 and 101 drafts read 550, and
        # the acceptance a mean of ratios); the acceptance is the sums' ratio again.
        for c in SUMMED_LEVEL_COLUMNS:
            if d.get(c):
                out[key][c] = int(sum(d[c]))
        n, a = out[key].get("draft_n"), out[key].get("draft_n_accepted")
        if n and a is not None:
            out[key]["draft_acceptance"] = a / n
    return out
