"""`powerprof analyze`: read run directories, analyse, write analysis.parquet/json, report.md/html and PNG plots.

The HTML report is one self-contained file: the plots are embedded as base64 PNG. Every file is
written to a temporary name and renamed, so a failed analysis leaves the previous one intact.
"""

from __future__ import annotations

import contextlib
import hashlib

import base64
import html
import json
import os
import re
import secrets
import stat
import struct
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np

from powerprof import __version__
from powerprof.storage.atomic import atomic_group
from powerprof.storage.runs import cwd_gone, missing_parent, no_finished_level, write_table
from powerprof.trust import out_dir_refusal

from .analyze import (AnalysisResult, SeriesResult, analyze, interrupted_cells, interrupted_findings,
                      interrupted_series_levels, run_notes, server_notes)
from .checks import Finding, sample_findings, saving_within_noise, unmeasured_level_findings
from .knobs import analyze_knobs, is_grid, left_out_text, summary_lines
from .loading import (AnalysisError, check_compatible, read_run_info, read_windows, run_key, sample_level_figures,
                      sweep_level_figures)
from .sweetspot import DESCRIPTIONS, POLICIES, PolicyParams, loss_text, slowdown_text

FORMATS = ("md", "html")


def analyze_run(
    run_dirs,
    out_dir=None,
    max_slowdown: float = 0.10,
    eta: float = 0.5,
    formats=FORMATS,
    force: bool = False,
    n_boot: int = 2000,
    seed=0,
    plots: bool = True,
    primary: str = "budget",
) -> AnalysisResult:
    """Analyse one or more run directories of the same GPU and model; write the outputs to `out_dir`
    (default: `<first run>/analysis`). Returns the result with `files` naming what was written.

    Raises AnalysisError for bad input (missing directory, unreadable files, incompatible runs)."""
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    run_dirs = [Path(p) for p in run_dirs]
    if not run_dirs:
        raise AnalysisError("give at least one run directory")
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise AnalysisError(f"unknown report format(s) {', '.join(bad)}; choose from {', '.join(FORMATS)}")
    try:
        params = PolicyParams(max_slowdown=max_slowdown, eta=eta)
    except ValueError as e:
        raise AnalysisError(str(e)) from None
    # One directory named twice (a glob and a path, a trailing slash) would count its windows twice and
    # narrow every CI by √2: each directory once, and a copy of a run (the same run_id) is refused.
    unique: dict[Path, Path] = {}
    for p in run_dirs:
        unique.setdefault(p.resolve(), p)
    run_dirs = list(unique.values())
    runs = [read_run_info(p) for p in run_dirs]
    for r in runs:
        # Ctrl-C before the first level ended keeps its tables: at most part of one level, compared with nothing.
        if (m := no_finished_level(r.path)) is not None:
            raise AnalysisError(m)
    forced = check_compatible(runs, force)
    seen: dict[tuple, Path] = {}
    for r in runs:
        key = run_key(r)
        if key in seen:
            raise AnalysisError(f"{seen[key]} and {r.path} hold the same run (run_id {r.run_id}): pooled, its "
                                "windows would count twice and every confidence interval be too narrow; give it once")
        seen[key] = r.path
    out = Path(out_dir) if out_dir is not None else run_dirs[0] / "analysis"
    if (why := cwd_gone(out)) is not None:  # before the checks' resolve() and abspath: a traceback, or said as root's
        raise AnalysisOutRefused(why)
    # As root (`sudo powerprof analyze`), the folder and every one on its way root's or the sudo user's: another
    # user's symlink at --out (or at RUN/analysis in their run) would have root write the report wherever it points.
    if (why := out_dir_refusal(out, "analysis folder")) is not None:
        raise AnalysisError(why)
    check_out(out, runs)  # before anything is read: nothing of the user's, or of other runs', is replaced
    if (why := missing_parent(out)) is not None:  # after check_out's own refusals; the default's parent is the run
        raise AnalysisOutRefused(why)
    with _out_locked(out) as (said, locked):
        check_out(out, runs)  # again, locked: another analyze into this folder may have written it meanwhile
        result = _analyze_into(out, runs, run_dirs, forced, params, max_slowdown, formats, n_boot, seed, plots, primary,
                               locked)
    result.write_notes += said
    return result


def _cannot_write(out: Path, e: OSError) -> AnalysisError:
    return AnalysisError(f"cannot write the analysis to {out}: {e.strerror or e}"
                         + (f" ({e.filename})" if e.filename and str(e.filename) != str(out) else ""))


@contextlib.contextmanager
def _out_locked(out: Path) -> Iterator[tuple[list[str], bool]]:
    """Hold an exclusive flock on the folder `out` (made here where missing, not its parent) from check_out to the
    last rename: two analyses into one folder mixed their files (one's report.md beside the other's analysis.json).
    The second is refused (AnalysisOutTaken), nothing written; a folder this made is removed again if the analysis
    fails (write_outputs relies on this: it makes and removes no folder). A file
    system that has no flock (ENOLCK: some network ones; EOPNOTSUPP) is written unlocked; another failure of the flock
    is written unlocked too, with a note in the list yielded: it was swallowed unsaid. Yields (that list, whether the
    flock is held)."""
    import errno  # noqa: PLC0415
    import fcntl  # noqa: PLC0415

    try:
        out.mkdir()  # its parent checked (missing_parent): one removed since is an error here, not made again
        made = True
    except FileExistsError:
        made = False
    except OSError as e:  # --out where no folder can be made (read-only, /proc)
        raise _cannot_write(out, e) from None
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise _cannot_write(out, e) from None
    said: list[str] = []
    locked = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            raise AnalysisOutTaken(f"another analyze is writing to {out} now: two at once would mix their files; wait "
                                   "for it to end, or give another folder with --out") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
                said.append(f"{out} could not be locked ({e.strerror or e}), so it was written unlocked: another "
                            "analyze into it at the same time would have mixed their files")
        try:
            yield said, locked
        except BaseException:
            if made:  # left empty by the group's undoing: nothing of a failed analysis stays
                with contextlib.suppress(OSError):
                    out.rmdir()
            raise
    finally:
        os.close(fd)


def _analyze_into(out: Path, runs, run_dirs, forced, params, max_slowdown, formats, n_boot, seed, plots,
                  primary, locked: bool) -> AnalysisResult:
    twice: dict = {}
    windows = read_windows(runs, twice)
    knob_result, where = _configurations(runs, max_slowdown, windows)
    # Judged over every configuration's windows: an interrupted one competes in the ranking too.
    stopped = (interrupted_findings(runs, windows) + unmeasured_level_findings(runs, windows)
               if knob_result is not None else [])
    if where is not None:
        # A configuration sweep: the power analysis is that of the J/token-optimal configuration only.
        windows = windows.filter(_matches(windows, where))
    figures = sweep_level_figures(runs, where)
    implausible: dict = {}
    scanned, timelines = sample_level_figures(runs, windows, implausible)
    for key, d in scanned.items():
        merged = figures.setdefault(key, {})
        for c, v in d.items():
            # The sweep's own figures win; samples fill what it did not write.
            if merged.get(c) is None and v is not None:
                merged[c] = v
    try:
        if knob_result is not None and (where is None or not _has_levels(windows)):
            # No configuration could be chosen (all left out), or none stepped levels: no power analysis.
            result = AnalysisResult(runs, [], [], params, timelines)
        else:
            cut = (interrupted_series_levels(runs, windows, where["config_id"], where["context_tokens"])
                   if where is not None else set())
            result = analyze(windows, runs, figures, timelines, params, n_boot=n_boot, seed=seed, primary=primary,
                             judge_interrupted=knob_result is None, interrupted_levels=cut,
                             config=_chosen_config(knob_result, where))
    except ValueError as e:
        raise AnalysisError(f"{', '.join(map(str, run_dirs))}: {e}") from None
    if knob_result is not None:
        result.knobs = knob_result
        result.warnings = list(knob_result.warnings) + [
            type(w)(w.kind, f"[{where['config_id'] if where else '-'}] {w.message}", w.levels)
            for w in result.warnings] + stopped
    # First among the warnings: every figure after it mixes what the runs differ in.
    result.warnings = [Finding("forced-pool", f"{d}, pooled anyway (--force): their levels are not comparable, so "
                               "every figure here mixes them; analyse them separately to compare them.")
                       for d in forced] + result.warnings + [
        Finding("duplicate-windows", f"{p}: {n} window rows are stored twice (the same run, level, request and "
                                     "times): each window is counted once. A file concatenated with a copy of itself, "
                                     "or written twice, holds them; the figures are those of the distinct windows.")
        for p, n in twice.items()] + sample_findings(implausible)
    result.notes, result.server_restarts = server_notes(runs)
    result.notes += run_notes(runs, result.warnings, result.notes)
    try:
        write_outputs(result, out, formats, plots, locked)
    except OSError as e:  # --out that cannot be written (read-only, full disk)
        raise _cannot_write(out, e) from None
    return result


class AnalysisOutRefused(AnalysisError):
    """--out names no place a folder can be made (its parent folder missing, a relative one from a removed current
    folder): a usage error, exit 2, as every command's (storage.runs.missing_parent); nothing read or made."""


class AnalysisOutTaken(AnalysisError):
    """The output folder holds an analysis of other runs, or files of the analysis' names that are no
    analysis: refused (exit 2, as an output file that exists), nothing replaced."""


# The names an analysis writes (plots get a series, context or run suffix): what a folder must not hold
# unless it is this analysis' own earlier output.
OUTPUT_NAMES = ("analysis.json", "analysis.parquet", "report.md", "report.html")
PLOT_STEMS = ("j_per_token", "tok_s", "saving_vs_loss", "power_clock", "config_heatmap")


def check_out(out: Path, runs) -> None:
    """Refuse an output folder whose files the analysis would replace, unless they are an earlier analysis of
    the very same runs (a re-analysis, with other options, replaces its own files together: docs/analysis.md).
    An analysis of other runs (`analyze a b` over a/analysis, run a's own, which `export a` shows as a's) or a
    file of these names that no analysis wrote (a person's report.md) is kept."""
    from powerprof.paths import path_problem  # noqa: PLC0415

    if (why := path_problem(out)) is not None:  # an OSError traceback from is_dir() ("File name too long")
        raise AnalysisOutRefused(f"--out {out}: {why}")  # a usage error, exit 2 (it was 1)
    _refuse_a_run_folder(out, runs)
    if not out.is_dir():
        return
    taken = sorted(f.name for f in _output_files(out))
    if not taken:
        return
    try:
        earlier = json.loads((out / "analysis.json").read_text())
        had = sorted({str(r["run_id"]) for r in earlier["runs"]})
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        had = None
    now = sorted({r.run_id for r in runs})
    if had == now:
        return
    what = (f"the analysis of {'run' if len(had) == 1 else 'runs'} {', '.join(had)}" if had is not None
            else f"files that are no powerprof analysis ({', '.join(taken[:4])}{', …' if len(taken) > 4 else ''})")
    raise AnalysisOutTaken(f"{out} holds {what}, which this analysis of {', '.join(now)} would replace; give another "
                           "folder with --out, or remove it first")


def _output_files(out: Path) -> list[Path]:
    """The files in `out` of an analysis' names (OUTPUT_NAMES, the plots)."""
    return [f for f in out.iterdir() if f.name in OUTPUT_NAMES or (
        f.suffix == ".png" and any(f.stem == s or f.stem.startswith(s + "_") for s in PLOT_STEMS))]


def _earlier_outputs(out: Path) -> list[Path]:
    """The files in `out` that powerprof can prove an earlier analysis wrote: the plain files that its analysis.json's
    `files` lists, and a report.md/report.html stamped with its analysis_id. Removing by name alone deleted a
    person's report.md, a copy j_per_token_before.png and a symlink of a plot's name."""
    try:
        earlier = json.loads((out / "analysis.json").read_text())
        listed, earlier_id = earlier.get("files") or {}, earlier.get("analysis_id")
        names = {Path(str(v)).name for v in listed.values()} if isinstance(listed, dict) else set()
    except (OSError, ValueError, AttributeError, RecursionError):
        names, earlier_id = set(), None
    found = []
    for f in _output_files(out):
        try:
            if not stat.S_ISREG(f.lstat().st_mode):
                continue
            ours = f.name in names or (
                earlier_id and f.name in ("report.md", "report.html") and _stamp_of(f) == earlier_id)
            if ours:
                found.append(f)
        except OSError:
            continue
    return found


_TEMPORARY = re.compile(r"\.(?P<name>[^/]+)\.(?P<pid>[0-9]+)\.[0-9a-f]{8}\.(?P<kind>tmp|old)")


def _dead_leftovers(out: Path, locked: bool) -> Iterator[tuple[Path, os.stat_result, bool]]:
    """(file, its lstat, whether it is a kept old copy) for each plain file in `out` of paths.temp_sibling's form
    (`.NAME.PID.HEX.tmp`, or atomic's `.old` link of an old content), NAME an output's, whose pid is no live process
    (a pid reused counts as alive; EPERM: another user's live process). An `.old` one goes by no pid where `locked`
    (this analyze holds the folder's flock, so no live analyze owns one), nor by this process's own pid (its atomic
    groups have ended): a kept old copy of a pid reused, or of a write that failed in this process, went unnamed."""
    for f in out.iterdir():
        m = _TEMPORARY.fullmatch(f.name)
        if m is None or not (m["name"] in OUTPUT_NAMES or (m["name"].endswith(".png") and any(
                m["name"][:-4] == s or m["name"].startswith(s + "_") for s in PLOT_STEMS))):
            continue
        try:
            if not (m["kind"] == "old" and (locked or int(m["pid"]) == os.getpid())):
                os.kill(int(m["pid"]), 0)
                continue
        except ProcessLookupError:
            pass
        except (OSError, OverflowError):
            continue
        try:
            st = f.lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            yield f, st, m["kind"] == "old"


def _second_names(out: Path, locked: bool) -> set[Path]:
    """The dead `.old` links in `out` that are still a second name of their file (a kill came before its rename): no
    old content of their own. Asked before the renames, after which each would be its file's only old copy."""
    return {f for f, st, old in _dead_leftovers(out, locked) if old and st.st_nlink > 1}


def _remove_dead_temporaries(out: Path, second_names: set[Path], locked: bool) -> list[Path]:
    """Remove the temporaries of an analyze that died (SIGKILL between its renames: nine stayed, one a hard link to the
    old analysis.parquet), plain files of this euid (another user's file of that form is not ours); returns those
    removed, for the note that says so. Called under the flock, so no analyze of this machine is writing here. A kept
    old link (`.old`) goes only among `second_names` (`_second_names`); one whose file was replaced before this write is
    the only copy of the old content: `_kept_old_copies`, never removed."""
    gone = []
    for f, st, old in _dead_leftovers(out, locked):
        if st.st_uid == os.geteuid() and (not old or f in second_names):
            with contextlib.suppress(OSError):
                f.unlink()
                gone.append(f)
    return gone


def _kept_old_copies(out: Path, second_names: set[Path], locked: bool) -> list[Path]:
    """The old contents a write that failed part-way (atomic.GroupMixed: the rename of one output and the put-back of
    another failed) or was killed after its renames left in `out`, each the only copy of an earlier content of an
    output: the next analyze removed them as a dead analyze's temporaries. Kept until the user removes them; each
    analyze names those of this euid (another user's file of that form is none of ours, as in the removal)."""
    return sorted(f for f, st, old in _dead_leftovers(out, locked)
                  if old and f not in second_names and st.st_uid == os.geteuid())


def _refuse_a_run_folder(out: Path, runs) -> None:
    """AnalysisOutTaken where `out` is a run directory (paths.holds_sweep_run), or the `analysis` folder of a run that is
    not among `runs`: `analyze a --out b` wrote a's report among run b's tables without a word, and in b/analysis
    `export b` shows it as b's own. An input's own RUN/analysis (the default) is its place; RUN itself is not."""
    from powerprof.paths import RUN_JSON, holds_sweep_run  # noqa: PLC0415

    def run_id(folder: Path) -> str:
        try:
            return str(json.loads((folder / RUN_JSON).read_text()).get("run_id") or "unknown")
        except (OSError, ValueError, AttributeError, RecursionError):
            return "unknown"

    inputs = {r.path.resolve() for r in runs}
    if holds_sweep_run(out):
        if out.resolve() in inputs:
            raise AnalysisOutTaken(f"--out {out} is the run directory itself: its analysis goes in {out / 'analysis'} "
                                   "(the default: give no --out), never among its tables")
        raise AnalysisOutTaken(f"--out {out} is the run directory of another run ({run_id(out)}): this analysis would "
                               "lie among its tables, read as that run's; give another folder with --out")
    from powerprof.paths import holds_dataset_tables  # noqa: PLC0415

    from .fleet import dataset_above  # noqa: PLC0415

    if (above := dataset_above(out)) is not None:
        raise AnalysisOutTaken(f"--out {out} is inside the daemon dataset {above}: this analysis's analysis.parquet "
                               "would be read as its rows, or as one more table of it; give another folder with --out")
    if holds_dataset_tables(out):
        # A daemon's data dir in RUN/analysis (taken before the daemon refused one inside a run): the report's
        # analysis.parquet among its datasets made `export` of that folder read it in their stead.
        raise AnalysisOutTaken(f"--out {out} holds a daemon's datasets (requests/, intervals/): this analysis's "
                               "analysis.parquet beside them would make `export` of that folder read it in their stead; "
                               "give another folder with --out" + (", or move the daemon's data out of the run"
                                                                  if holds_sweep_run(out.parent) else ""))
    if out.name == "analysis" and holds_sweep_run(out.parent) and out.parent.resolve() not in inputs:
        raise AnalysisOutTaken(f"--out {out} is the analysis folder of another run, {out.parent} ({run_id(out.parent)}), "
                               f"not analysed here: `export {out.parent}` would show this analysis as that run's; give "
                               "another folder with --out")


def _configurations(runs, max_slowdown: float, windows):
    """(KnobResult, {config_id, context_tokens} of the J/token-optimal configuration) for a
    configuration sweep, (KnobResult, None) when every measured one is left out; (None, None)
    otherwise."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for r in runs:
        p = r.path / "levels.parquet"
        if p.exists():
            try:
                tables.append(pq.read_table(p).replace_schema_metadata(None))
            except (pa.ArrowInvalid, OSError) as e:
                raise AnalysisError(f"{p}: cannot be read as Parquet ({e})") from None
    if not tables:
        return None, None
    levels = pa.concat_tables(tables, promote_options="permissive")
    if not is_grid(levels):
        return None, None
    kr = analyze_knobs(levels, max_slowdown, interrupted=interrupted_cells(runs, windows))
    if not any(p.measured for p in kr.points):
        # The reason is the point: "as-launched: failed" alone sent the user to levels.parquet for the
        # HTTP 413 behind it. Its first line only: the server log's tail follows it in config_error.
        raise AnalysisError("no configuration of the sweep was measured: " + "; ".join(
            f"{p.label()}: {p.status}" + (f" ({p.error.strip().splitlines()[0]})" if p.error and p.error.strip() else "")
            for p in kr.points))
    if kr.chosen is None:
        return kr, None
    return kr, {"config_id": kr.chosen.config_id, "context_tokens": kr.chosen.context_tokens}


def _chosen_config(kr, where: dict | None) -> dict | None:
    """The chosen configuration's labels for its analysis rows (config_id, context_tokens, config_status, knob_*):
    the power-limit analysis is of it alone (docs/sweep.md, Analysis); None outside a configuration sweep."""
    if kr is None or where is None or kr.chosen is None:
        return None
    from powerprof.storage.schema import KNOB_PREFIX  # noqa: PLC0415

    return {**where, "config_status": kr.chosen.status,
            **{f"{KNOB_PREFIX}{k}": v for k, v in (kr.chosen.knobs or {}).items()}}


def _matches(windows, where: dict):
    import pyarrow as pa
    import pyarrow.compute as pc

    mask = pa.array([True] * windows.num_rows)
    for k, v in where.items():
        col = windows.column(k)
        mask = pc.and_(mask, pc.is_null(col) if v is None else pc.fill_null(pc.equal(col, v), False))
    return mask


def _has_levels(windows) -> bool:
    kinds = set(windows.column("level_kind").to_pylist()) if windows.num_rows else set()
    return bool(kinds & {"power_limit", "sm_clock"})


def write_outputs(result: AnalysisResult, out: Path, formats=FORMATS, plots: bool = True,
                  locked: bool = False) -> dict[str, str]:
    # `out` is made, and taken back where the analysis fails, by _out_locked: not made again here, where a folder
    # removed meanwhile would be one no lock holds. `locked`: _out_locked holds its flock (_dead_leftovers).
    # All or none: an interruption while the report renders must not leave new plots and tables beside
    # the old report and analysis.json (the export's summary sheet reads its recommendation).
    result.analysis_id = secrets.token_hex(8)
    second_names = _second_names(out, locked)
    with atomic_group() as stage:
        files = _write_outputs(result, out, formats, plots, stage)
        # An earlier analysis' report.md or plot that this one does not write (--format html, --no-plots, other
        # series) goes with it: beside the new analysis.json it gave the old recommendation.
        for f in _earlier_outputs(out):
            if f not in stage.paths():
                stage.remove(f)
    if gone := _remove_dead_temporaries(out, second_names, locked):
        result.write_notes.append(
            f"removed {len(gone)} temporary file{'s' if len(gone) > 1 else ''} that an analyze stopped part-way left in "
            f"{out} ({', '.join(sorted(f.name for f in gone))})")
    if kept := _kept_old_copies(out, second_names, locked):
        # Warned, not refused: writing every output again is the fix GroupMixed gave, and it leaves these alone. Not
        # "left the folder MIXED": a kill after every rename leaves them in a folder of one analysis (the ids say).
        result.write_notes.append(
            f"{out} holds an earlier content of {', '.join(_TEMPORARY.fullmatch(f.name)['name'] for f in kept)}, kept "
            f"as {', '.join(f.name for f in kept)} by an earlier write that failed or was killed part-way; this "
            "analysis replaced every output together, and the kept copies are left as they are (the only copies of "
            "that content): look at them, then remove them when you no longer need them")
    return files


def _write_outputs(result: AnalysisResult, out: Path, formats, plots: bool, stage) -> dict[str, str]:
    from . import plots as P  # noqa: PLC0415  (matplotlib is slow to import; only here)

    files: dict[str, str] = {}
    images: dict[str, Path] = {}  # final names, for the links
    drawn: dict[Path, Path] = {}  # final name → its staged temporary, which the HTML embeds
    if plots:
        for sr in result.series:
            for name, fn in (("j_per_token", P.plot_j_per_token), ("tok_s", P.plot_tok_s),
                             ("saving_vs_loss", P.plot_tradeoff)):
                images[f"{name}{sr.suffix}"] = _staged_png(stage, drawn, out / f"{name}{sr.suffix}.png", lambda p: fn(sr, p))
        if result.knobs is not None:
            from .knobs import heatmap_axes

            axes = heatmap_axes(result.knobs)
            if axes is not None:
                for ctx in result.knobs.by_context:
                    key = "config_heatmap" + ("" if ctx is None else f"_ctx{ctx}")
                    images[key] = _staged_png(stage, drawn, out / f"{key}.png", lambda p: P.plot_knob_heatmap(result.knobs, *axes, p, ctx))
        ids = [tl.run_id for tl in result.timelines]
        if note := _same_name_note(ids, _timeline_keys(ids)):
            result.notes.append(note)
        for tl, key in zip(result.timelines, _timeline_keys(ids)):
            # By directory, not run id: two runs of one id (--force) each drew the first one's idle power and unit.
            meta = next((r.meta for r in result.runs if r.path == tl.path), {})
            unit = "MHz" if (meta.get("settings") or {}).get("level_kind") == "sm_clock" else "W"
            images[key] = _staged_png(stage, drawn, out / f"{key}.png", lambda p: P.plot_timeline(
                tl, p, level_unit=unit, idle_power_w=meta.get("idle_gpu_power_w"),
                idle_by_device_w=meta.get("idle_gpu_power_w_by_gpu")))
    for tmp in drawn.values():  # the id in each plot too: a kill after the plots' renames left new ones unsaid
        tmp.write_bytes(_png_with_comment(tmp.read_bytes(), result.analysis_id))
    files.update({k: str(v) for k, v in images.items()})
    meta = {"powerprof_analysis": json.dumps(result.to_dict(), default=_json_default)}
    write_table(stage(out / "analysis.parquet"), result.table, meta)
    files["analysis.parquet"] = str(out / "analysis.parquet")
    if "md" in formats:
        stage(out / "report.md").write_bytes((render_markdown(result, images, out) + _id_stamp(result)).encode())
        files["report.md"] = str(out / "report.md")
    if "html" in formats:
        stage(out / "report.html").write_bytes((render_html(result, {k: drawn[v] for k, v in images.items()})
                                                + _id_stamp(result)).encode())
        files["report.html"] = str(out / "report.html")
    files["analysis.json"] = str(out / "analysis.json")
    result.files = files
    stage(out / "analysis.json").write_bytes(result_json(result).encode())
    return files


def result_json(result: AnalysisResult) -> str:
    """analysis.json's text, which `analyze --json` prints too."""
    return json.dumps(result.to_dict(), indent=2, default=_json_default)


ID_STAMP = re.compile(r"<!-- powerprof analysis_id: ([0-9a-f]+) -->")


def _id_stamp(result: AnalysisResult) -> str:
    """The reports' last line, unseen where rendered: the analysis id that analysis.json and analysis.parquet say."""
    return f"\n<!-- powerprof analysis_id: {result.analysis_id} -->\n"


def _stamp_of(report: Path | str, fs=None) -> str | None:
    """The analysis_id stamped in a report's last line; None where there is none (a person's file, an edited one).
    `fs`: a pyarrow filesystem `report` (its path there) is read through, its last 200 bytes alone."""
    if fs is None:
        with open(report, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 200))
            tail = f.read()
    else:
        with fs.open_input_file(report) as f:
            f.seek(max(0, f.size() - 200))
            tail = f.read()
    m = ID_STAMP.search(tail.decode(errors="replace"))
    return m.group(1) if m else None


def _ids(folder: Path | str, names, fs=None, unread: dict[str, str] | None = None) -> dict[str, str | None]:
    """The analysis_id each of `names` in `folder` says (None: none said); a name not there is left out, and so is one
    that cannot be read, its error put in `unread` where given. `fs`: a pyarrow filesystem `folder` (its path there) is
    read through (a remote URI's)."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    ids: dict[str, str | None] = {}
    for name in names:
        f = folder / name if fs is None else f"{str(folder).rstrip('/')}/{name}"
        try:
            if not (f.is_file() if fs is None else fs.get_file_info(f).is_file):
                continue
        except (OSError, pa.ArrowException):  # a store that cannot be reached: its read says why
            continue
        try:
            if name == "analysis.json":
                if fs is None:
                    text = f.read_text()
                else:
                    with fs.open_input_stream(f) as stream:
                        text = stream.read().decode()
                doc = json.loads(text)
                ids[name] = doc.get("analysis_id") if isinstance(doc, dict) else None
            elif name == "analysis.parquet":
                meta = pq.read_schema(f, filesystem=fs).metadata or {}
                doc = json.loads(meta.get(b"powerprof_analysis", b"{}"))
                ids[name] = doc.get("analysis_id") if isinstance(doc, dict) else None
            elif name.endswith(".png"):
                if fs is None:
                    ids[name] = _png_comment(f.read_bytes())
                else:
                    with fs.open_input_stream(f) as stream:
                        ids[name] = _png_comment(stream.read())
            else:
                ids[name] = _stamp_of(f, fs)
        except RecursionError:  # nested past Python's stack ("[" * 200000): a traceback, local and remote
            if unread is not None:
                unread[name] = "not valid JSON (nested deeper than Python's parser goes)"
        except (OSError, ValueError, pa.ArrowException) as e:
            # Not an id of None: a read that failed (S3's AccessDenied on analysis.json alone) was counted as one, and
            # a good export refused as "more than one analysis (analysis.json none, ...)".
            if unread is not None:
                unread[name] = str(e)
    return ids


def outputs_disagree(folder: Path | str, fs=None, shown: str | None = None,
                     notes: list[str] | None = None) -> str | None:
    """Why the analysis tables in `folder` that export reads (analysis.json, analysis.parquet) are not of one write
    (their analysis ids differ: an analyze killed between its renames, SIGKILL or a power cut, left one new beside
    one old); None where they agree or one is missing. Outputs of before the ids (neither says one) agree.
    The reports, which export never reads, are no cause (`unread_outputs_disagree`): refusing for them, with "run analyze
    again" as the fix, had a person's notes in report.md overwritten. `fs`: read through it (a remote URI's), the
    folder `shown` by its URI. One that cannot be read is compared with nothing: a note in `notes` names it and why."""
    unread: dict[str, str] = {}
    ids = _ids(folder, ("analysis.json", "analysis.parquet"), fs, unread)
    shown = shown or str(folder)
    if notes is not None:
        notes.extend(f"{shown.rstrip('/')}/{n} could not be read ({e}), so whether it and the other analysis table "
                     "there are of one analysis was not checked" for n, e in unread.items())
    if len(set(ids.values())) <= 1:
        return None
    return (f"{shown} holds the outputs of more than one analysis (their analysis ids differ: "
            + ", ".join(f"{n} {i or 'none'}" for n, i in ids.items())
            + "; an analyze stopped between its renames); run `powerprof analyze` again to write them anew")


def unread_outputs_disagree(folder: Path | str, fs=None, shown: str | None = None) -> list[str]:
    """A note for each report in `folder`, and each plot its analysis.json lists, stamped with another analysis' id
    than analysis.json's: what it shows may not be what is exported. One with no stamp (an edited report, a person's
    own, of before the ids) says nothing. `fs`: read through it (a remote URI's: s3://, gs://, which got no note), the
    folder `shown` by its URI."""
    import pyarrow as pa  # noqa: PLC0415

    def at(name: str) -> str:
        return f"{str(shown or folder).rstrip('/')}/{name}"

    try:
        if fs is None:
            text = (Path(folder) / "analysis.json").read_text()
        else:
            with fs.open_input_stream(f"{str(folder).rstrip('/')}/analysis.json") as stream:
                text = stream.read().decode()
        listed = json.loads(text).get("files") or {}
        plots = sorted({Path(str(v)).name for v in listed.values()} if isinstance(listed, dict) else set())
    except (OSError, ValueError, AttributeError, RecursionError, pa.ArrowException):
        plots = []
    ids = _ids(folder, ("analysis.json", "report.md", "report.html", *(n for n in plots if n.endswith(".png"))), fs)
    now = ids.pop("analysis.json", None)
    return [f"{at(n)} is of another analysis (analysis_id {i}) than {at('analysis.json')} ({now}): what "
            "it shows may not be what is exported; `powerprof analyze` again writes it anew (replacing it)"
            for n, i in ids.items() if now and i and i != now]


def _png_with_comment(png: bytes, text: str) -> bytes:
    """`png` with a tEXt chunk `Comment` = text before its IEND (the PNG spec's place for free text)."""
    body = b"Comment\0" + text.encode("latin-1")
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body))
    end = png.rindex(b"IEND") - 4
    return png[:end] + chunk + png[end:]


def _png_comment(png: bytes) -> str | None:
    """A PNG's tEXt `Comment` (the analysis_id _png_with_comment put there); None where it has none."""
    at = 8
    while at + 8 <= len(png):
        size, kind = struct.unpack(">I4s", png[at:at + 8])
        if kind == b"tEXt" and png[at + 8:at + 16] == b"Comment\0":
            return png[at + 16:at + 8 + size].decode("latin-1")
        if kind == b"IEND":
            break
        at += 12 + size
    return None


def _staged_png(stage, drawn: dict, path: Path, draw) -> Path:
    drawn[path] = stage(path)
    draw(drawn[path])
    return path


def _safe(s: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in s)


def _timeline_keys(run_ids: list[str]) -> list[str]:
    """Each timeline's power_clock plot name, in order: `power_clock` alone, else `power_clock_<safe id>`; where two
    ids make one safe name ('r.1', 'r-1') each adds a short hash of its raw id, whatever the runs' order, and one id
    given by several runs (pooled with --force) adds their place among them (_1, _2 in the order given). One plot was
    drawn twice, the other run's timeline missing unsaid. Those names can still meet another run's (runs a, a, a_1
    both gave power_clock_a_1; staged twice, analyze ended in a traceback): a name an earlier run's plot took gets the
    first counter (_2, _3) that no run's name is, so each run keeps its plot and the same order gives the same names."""
    if len(run_ids) == 1:
        return ["power_clock"]
    safe = [_safe(r) for r in run_ids]
    wanted = []
    for i, (r, s) in enumerate(zip(run_ids, safe)):
        key = f"power_clock_{s}"
        if len({x for x, y in zip(run_ids, safe) if y == s}) > 1:
            key += f"_{hashlib.sha256(r.encode()).hexdigest()[:8]}"
        if run_ids.count(r) > 1:
            key += f"_{run_ids[:i].count(r) + 1}"
        wanted.append(key)
    taken = set(wanted)
    keys: list[str] = []
    for key in wanted:
        if key in keys:
            n = 2
            while f"{key}_{n}" in taken:
                n += 1
            key = f"{key}_{n}"
            taken.add(key)
        keys.append(key)
    return keys


def _same_name_note(run_ids: list[str], keys: list[str]) -> str | None:
    """The report's note naming the plots that `_timeline_keys` gave more than the run id, with their runs."""
    named = [(k, r) for r, k in zip(run_ids, keys) if k not in ("power_clock", f"power_clock_{_safe(r)}")]
    if not named:
        return None
    return ("runs whose ids make one file name get power_clock plots named with a short hash of the id, or (one id "
            "given by several runs) their place in the order given, and a name an earlier run's plot took a counter: " + ", ".join(f"{k}.png (run {r})" for k, r in named))


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


# --- text ------------------------------------------------------------------------------------


def _unit(sr: SeriesResult) -> str:
    return "MHz" if sr.series.level_kind == "sm_clock" else "W"


def _f(x, fmt=".3g", none="–") -> str:
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return none
    return format(x, fmt)


def _knob_head(result: AnalysisResult) -> list[str]:
    if result.knobs is None:
        return []
    c = result.knobs.chosen
    never = left_out_text({p.cell(): p.left_out for p in result.knobs.left_out}, "measure them again to compare them")
    if c is None:
        first = "No configuration could be chosen: every measured one is left out."
    else:
        tail = (f"; its power levels follow" if result.has_levels else
                "; no power levels were stepped (add --limits to find its sweet-spot power limit)")
        first = f"J/token-optimal configuration: {c.label()}{tail}."
    return [first + (" " + never if never else "")] + summary_lines(result.knobs)


def recommendation_line(result: AnalysisResult) -> str:
    if not result.has_levels:
        return _knob_head(result)[0] if result.knobs is not None else "No levels to recommend from."
    sr = result.main
    c = sr.recommendation
    u = _unit(sr)
    what = "limit" if u == "W" else "SM clock lock"
    if not sr.comparable:
        # Its "0.0% slower, 0.0% less energy" would be against itself: no figure, so none is printed.
        line = (f"One level measured ({c.level_value:g} {u}): nothing to compare it with, so no {what} is "
                f"recommended; sweep several levels (e.g. --{'limits' if u == 'W' else 'clocks'} with four values) "
                "to find the sweet spot.")
        return line + (" (simulated)" if result.simulated else "")
    noise = saving_within_noise(c, sr.table, sr.series.reference_value)
    if noise is not None:
        # A slower setting whose saving the CI cannot tell from none is no sweet spot: say so, not "run at X".
        line = (f"No measured {what} is shown to save energy against {sr.series.reference_value:g} {u}, the reference "
                f"({DESCRIPTIONS[c.policy]}" + (f", ≤ {slowdown_text(c.params['max_slowdown'])} slower" if c.policy == "budget" else "")
                + f"): its best, {c.level_value:g} {u}, is {_loss(c.speed_loss_pct, sr)}% slower and {c.energy_saving_pct:.1f}% "
                f"less energy per token, 95% CI [{noise[0]:.1f}, {noise[1]:.1f}]%, a saving within noise; keep "
                f"{sr.series.reference_value:g} {u}, or measure more requests per level (more distinct prompts) to settle it.")
        if c.left_out:
            line += " " + left_out_text({f"{v:g} {u}": why for v, why in c.left_out.items()})
        return line + (" (simulated)" if result.simulated else "")
    head = (f"Recommended {what}: {c.recommended_value:g} {u}"
            + (", the reference" if c.level_value == sr.series.reference_value else "")
            + f" ({DESCRIPTIONS[c.policy]}" + (f", ≤ {slowdown_text(c.params['max_slowdown'])} slower" if c.policy == "budget" else "")
            + "): ")
    head += _figures_text(c)
    if c.level_value == sr.series.reference_value:
        # "0.0% slower, 0.0% less energy per token than 300 W" would compare it with itself.
        line = head + _why_the_reference(sr, c, u) + "; " + _choice_range_text(sr, c, u)
    else:
        line = (head + f"{_loss(c.speed_loss_pct, sr)}% slower, {c.energy_saving_pct:.1f}% less energy per token than "
                f"{sr.series.reference_value:g} {u}; " + _choice_range_text(sr, c, u))
    if c.left_out:
        line += " " + left_out_text({f"{v:g} {u}": why for v, why in c.left_out.items()})
    if result.simulated:
        line += " (simulated)"
    return line


def _figures_text(c) -> str:
    """The chosen level's own figures, the answer to "how much energy per token" (the line gave only its
    speed loss and saving, relative to the reference); '' where one is unknown."""
    jpt, tok_s = c.gpu_j_per_token, c.decode_tok_s
    if jpt is None or tok_s is None or not (np.isfinite(jpt) and np.isfinite(tok_s)):
        return ""
    return f"{jpt:.3f} J/token on the GPU at {tok_s:.1f} tok/s decode{concurrency_words(c.concurrency)}; "


def concurrency_words(concurrency) -> str:
    """What a figure measured above one stream is over (its tok/s the streams' together, its J/token per token of
    them all), said beside it: a `--concurrency 4` run's J/token read as one stream's. '' at concurrency 1."""
    n = int(concurrency or 1)
    return "" if n <= 1 else f" at concurrency {n} (the {n} streams together)"


def _why_the_reference(sr: SeriesResult, c, u: str) -> str:
    """Why no level other than the reference was chosen: the nearest one below it, by the policy's measure."""
    below = [r for r in sr.table.to_pylist() if r["level_value"] < sr.series.reference_value
             and r["level_value"] not in c.left_out]
    # A level without tok/s or J/token is neither slower nor costlier: it is not compared at all.
    blank = [r for r in below if r["speed_loss_pct"] is None or r["gpu_j_per_token"] is None]
    below = [r for r in below if r not in blank]
    names = ", ".join(f"{r['level_value']:g} {u}" for r in blank)
    return _why_the_reference_of(below, sr, c, u) + (
        f"; {names} {'has' if len(blank) == 1 else 'have'} no figures to compare (no measured window with a GPU "
        "energy)" if blank else "")


def _why_the_reference_of(below: list[dict], sr: SeriesResult, c, u: str) -> str:
    if not below and c.left_out:
        return "every other level is left out"
    if not below:
        return "no lower level has figures to compare"
    if c.policy == "budget" and below:
        within = [r for r in below if r["speed_loss_pct"] is not None
                  and r["speed_loss_pct"] <= c.params["max_slowdown"] * 100 + 1e-10]
        if within:
            # A lower level within the budget lost on energy, not speed: "slower than the budget allows" was false.
            r = min(within, key=lambda r: r["gpu_j_per_token"] if r["gpu_j_per_token"] is not None else np.inf)
            return (f"no lower level within the budget uses less energy per token ({r['level_value']:g} {u}: "
                    f"{_loss(r['speed_loss_pct'], sr)}% slower, {_saving_words(r['energy_saving_pct'])})")
        r = max(below, key=lambda r: r["level_value"])
        return (f"every lower level is slower than the budget allows ({r['level_value']:g} {u}: "
                f"{_loss(r['speed_loss_pct'], sr)}% slower, {_saving_words(r['energy_saving_pct'])})")
    return "no other measured level does better by this measure"


def _saving_words(saving_pct) -> str:
    """"3.1% less energy per token", or "2.6% more" where it is negative ("-2.6% less" read as a saving)."""
    if saving_pct is None or not np.isfinite(saving_pct):
        return "energy per token unknown"
    return f"{abs(saving_pct):.1f}% {'less' if saving_pct >= 0 else 'more'} energy per token"


def _choice_range_text(sr: SeriesResult, c, u: str) -> str:
    """Where the bootstrap puts the choice; a range covering every measured level says nothing."""
    lv = sr.series.level_values
    if sr.series.n_windows.size and sr.series.n_windows.max() <= 1:
        # Why each level has one, and its fix, differ by run (a trace replayed once, requests failed or left out):
        # the one-window warning says them; a fix here told a non-trace run to use --repeats.
        return "one window per level: no resampling spread (the one-window warning says why, and the fix)."
    if lv.size > 1 and c.ci_low <= float(lv.min()) and c.ci_high >= float(lv.max()):
        return (f"uncertain choice: resamples choose levels across the whole measured range "
                f"({c.ci_low:g}–{c.ci_high:g} {u}); more requests per level would settle it.")
    return f"95% of resamples choose {c.ci_low:g}–{c.ci_high:g} {u}."


def _levels_rows(sr: SeriesResult) -> tuple[list[str], list[list[str]]]:
    u = _unit(sr)
    head = [f"level ({u})", "tok/s [95% CI]", "J/token [95% CI]", "speed loss % [CI]", "energy saving % [CI]",
            "power (W)", "SM clock (MHz)", "requests", "chosen by", "flags"]
    rows = []
    for r in sr.table.to_pylist():
        rows.append([
            f"{r['level_value']:g}" + (" (ref)" if r["reference"] else ""),
            f"{_f(r['decode_tok_s'], '.1f')} [{_f(r['decode_tok_s_ci_low'], '.1f')}, {_f(r['decode_tok_s_ci_high'], '.1f')}]",
            f"{_f(r['gpu_j_per_token'], '.3f')} [{_f(r['gpu_j_per_token_ci_low'], '.3f')}, "
            f"{_f(r['gpu_j_per_token_ci_high'], '.3f')}]",
            f"{_loss(r['speed_loss_pct'], sr)} [{_f(r['speed_loss_pct_ci_low'], '.1f')}, {_f(r['speed_loss_pct_ci_high'], '.1f')}]",
            f"{_f(r['energy_saving_pct'], '.1f')} [{_f(r['energy_saving_pct_ci_low'], '.1f')}, "
            f"{_f(r['energy_saving_pct_ci_high'], '.1f')}]",
            _f(r["avg_gpu_power_w"], ".0f"),
            _f(r["sm_clock_mhz"], ".0f"),
            f"{r['n_requests']}" + (f" (+{r['n_failed']} failed)" if r["n_failed"] else ""),
            r["chosen_by"] or "",
            "; ".join(x for x in (r["flags"], _never_chosen(r)) if x),
        ])
    return head, rows


def _never_chosen(row: dict) -> str:
    """'never chosen: interrupted' for a level no policy may choose: an interrupted level's row had no flag,
    its figures in the table as if they stood ("they stay in the tables with their flags")."""
    return f"never chosen: {row['left_out']}" if row.get("left_out") else ""


def _choice_rows(sr: SeriesResult) -> tuple[list[str], list[list[str]]]:
    u = _unit(sr)
    head = ["policy", "criterion", f"choice ({u})", f"95% CI ({u})", "stability", f"between levels ({u})",
            "speed loss %", "energy saving %"]
    rows = []
    for p in POLICIES:
        c = sr.choices[p]
        crit = DESCRIPTIONS[p]
        if p == "budget":
            crit += f" (≤ {slowdown_text(c.params['max_slowdown'])})"
        if p == "weighted":
            crit += f" (η = {c.params['eta']:g}, P_max = {_f(c.params['p_max_w'], '.0f')} W)"
        rows.append([p, crit, f"{c.level_value:g}" + (" ★" if p == sr.primary and sr.starred else ""),
                     f"{c.ci_low:g}–{c.ci_high:g}", f"{c.stability:.0%}", _f(c.interpolated_value, "g"),
                     _loss(c.speed_loss_pct, sr), f"{c.energy_saving_pct:.1f}"])
    return head, rows


def _fit_rows(sr: SeriesResult) -> tuple[list[str], list[list[str]]]:
    head = ["quantity", "model", "parameters ± std. error", "R²", "RMSE", "residuals at levels", "note"]
    rows = []
    for q, f in sr.fits.items():
        if not f.ok:
            rows.append([q, f.model, "–", "–", "–", "–", f.message])
            continue
        params = ", ".join(f"{k} = {v:.4g} ± {_f(f.stderr.get(k), '.2g')}" for k, v in f.params.items())
        rows.append([q, f.model, params, _f(f.r2, ".4f"), _f(f.rmse, ".3g"),
                     ", ".join(f"{r:+.3g}" for r in f.residuals), f.message])
    return head, rows


def _resampling(sr: SeriesResult) -> str:
    if getattr(sr.series, "bootstrap", "independent") == "paired-by-prompt":
        return "bootstrap resamples of the prompts, the same draw at every level (paired)"
    return "bootstrap resamples of the requests, each level on its own"


def _md_table(head, rows) -> str:
    esc = [[c.replace("|", "\\|") for c in r] for r in rows]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in esc])


def _runs_lines(result: AnalysisResult) -> list[str]:
    return [f"{r.run_id}: {r.gpu_name or 'unknown GPU'}, model {r.model or 'unknown'}"
            + (" (simulated)" if r.simulated else "") + f" — {r.path}" for r in result.runs]


def render_markdown(result: AnalysisResult, images: dict[str, Path] | None = None, base: Path | None = None) -> str:
    out = ["# powerprof analysis", ""]
    if result.simulated:
        out += [f"> **Simulated**: {result.simulated_note}.", ""]
    out += [f"**{recommendation_line(result)}**", "", "Runs pooled:", ""] + [f"- {x}" for x in _runs_lines(result)]
    if result.knobs is not None:
        from .knobs import markdown_lines

        out += ["", "## Configurations", ""] + [f"- {x}" for x in _knob_head(result)] + [""] + markdown_lines(result.knobs)
        out += ["", "Each configuration at its reference level (the default limit, else the highest measured; "
                "'as is' when no levels were stepped)."]
        for key in sorted(k for k in (images or {}) if k.startswith("config_heatmap")):
            out += ["", f"![{key}]({_rel(images[key], base)})"]
        if result.has_levels:
            out += ["", f"## Power levels of {result.knobs.chosen.label()}"]
    for sr in result.series:
        out += ["", f"## {sr.label.capitalize()} (reference {sr.series.reference_value:g} {_unit(sr)})", "",
                "### Levels", "", _md_table(*_levels_rows(sr)), "", "### Sweet spots", ""]
        out += ([_md_table(*_choice_rows(sr)), "", _choice_footnote(sr)] if sr.comparable else [_ONE_LEVEL])
        out += ["", "### Fits", "", _md_table(*_fit_rows(sr))]
        for key in (f"j_per_token{sr.suffix}", f"tok_s{sr.suffix}", f"saving_vs_loss{sr.suffix}"):
            if images and key in images:
                out += ["", f"![{key}]({_rel(images[key], base)})"]
    if result.warnings:
        out += ["", "## Warnings", ""] + [f"- **{w.kind}**: {w.message}" for w in result.warnings]
    if result.notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in result.notes]
    for key in sorted(k for k in (images or {}) if k.startswith("power_clock")):
        out += ["", "## Power and SM clock over time", "", f"![{key}]({_rel(images[key], base)})"]
    out += ["", f"_{_colophon()}_", ""]
    return "\n".join(out)


_ONE_LEVEL = "One level measured: no sweet spot to choose (a policy compares levels); sweep several levels."


def _choice_footnote(sr: SeriesResult) -> str:
    star = "★ the recommended policy." if sr.starred else (
        f"No ★: the recommended policy's level, {sr.recommendation.level_value:g} {_unit(sr)}, is not shown to save "
        f"energy against {sr.series.reference_value:g} {_unit(sr)} (its saving's 95% CI reaches 0), so no level is "
        "marked, here or in the plots.")
    return star + " CI: the levels chosen in 95% of " + _resampling(sr) + "; stability: the share choosing the same level."


def _colophon() -> str:
    return f"powerprof {__version__}; statistics and policies: docs/analysis.md."


def _rel(p: Path, base: Path | None) -> str:
    return os.path.relpath(p, base) if base is not None else str(p)


def _html_table(head, rows) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<figure id="{html.escape(alt)}"><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></figure>'


# Plots fill the text column (up to their 990 px native width), whatever the window size.
_CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
figure{margin:1em 0}figure img{width:100%;max-width:990px;height:auto;display:block}.note{color:#555}
table{border-collapse:collapse;font-size:0.85em;margin:0.5em 0}td,th{border:1px solid #ccc;padding:3px 6px;
text-align:left}th{background:#f3f3f3}.rec{font-size:1.1em;background:#eef6ee;padding:0.6em;border-left:4px solid
#393}.sim{background:#fff3cd;padding:0.5em}li{margin:0.3em 0}"""


def render_html(result: AnalysisResult, images: dict[str, Path] | None = None) -> str:
    images = images or {}
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>powerprof analysis</title>",
             f"<style>{_CSS}</style></head><body><h1>powerprof analysis</h1>"]
    if result.simulated:
        parts.append(f"<p class='sim'><b>Simulated</b>: {html.escape(result.simulated_note)}.</p>")
    parts.append(f"<p class='rec'>{html.escape(recommendation_line(result))}</p><p>Runs pooled:</p><ul>")
    parts += [f"<li>{html.escape(x)}</li>" for x in _runs_lines(result)]
    parts.append("</ul>")
    if result.knobs is not None:
        from .knobs import markdown_lines

        rows = [[c.strip() for c in line.strip("|").split("|")] for line in markdown_lines(result.knobs)]
        parts.append("<h2>Configurations</h2><ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in _knob_head(result))
                     + "</ul>" + _html_table(rows[0], rows[2:]))
        for key in sorted(k for k in images if k.startswith("config_heatmap")):
            parts.append(_img(images[key], key))
    for sr in result.series:
        parts.append(f"<h2>{html.escape(sr.label.capitalize())} (reference {sr.series.reference_value:g} "
                     f"{_unit(sr)})</h2><h3>Levels</h3>{_html_table(*_levels_rows(sr))}")
        parts.append(f"<h3>Sweet spots</h3>{_html_table(*_choice_rows(sr))}"
                     f"<p class='note'>{html.escape(_choice_footnote(sr))}</p>" if sr.comparable else
                     f"<h3>Sweet spots</h3><p class='note'>{html.escape(_ONE_LEVEL)}</p>")
        parts.append(f"<h3>Fits</h3>{_html_table(*_fit_rows(sr))}")
        for key in (f"j_per_token{sr.suffix}", f"tok_s{sr.suffix}", f"saving_vs_loss{sr.suffix}"):
            if key in images:
                parts.append(_img(images[key], key))
    if result.warnings:
        parts.append("<h2>Warnings</h2><ul>" + "".join(
            f"<li><b>{html.escape(w.kind)}</b>: {html.escape(w.message)}</li>" for w in result.warnings) + "</ul>")
    if result.notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in result.notes) + "</ul>")
    for key in sorted(k for k in images if k.startswith("power_clock")):
        parts.append(f"<h2>Power and SM clock over time</h2>{_img(images[key], key)}")
    parts.append(f"<p><small><i>{html.escape(_colophon())}</i></small></p></body></html>")
    return "\n".join(parts)


def console_summary(result: AnalysisResult, table: bool = True, width: int | None = None) -> str:
    """A compact plain-text summary (levels, sweet spots, recommendation, warnings) for the terminal.

    table=False leaves the levels out, for a caller (the sweep) that has printed its own table.
    width: the terminal's columns; every line is wrapped to it between words, so no figure, flag or
    path is split (the terminal's own wrapping cut "2.568" into "2.5" and "68"). None: no wrapping."""
    if result.knobs is not None:
        head = _knob_head(result)
        if not result.has_levels:
            lines = head + [f"! {w.kind}: {w.message}" for w in result.warnings]
            if result.files.get("report.html"):
                lines.append(f"Report: {result.files['report.html']}")
            return _wrapped(lines, width)
        return _wrapped(head, width) + "\n\n" + _levels_summary(result, table, width)
    return _levels_summary(result, table, width)


def _wrapped(lines: list[str], width: int | None) -> str:
    if width is None:
        return "\n".join(lines)
    out = []
    for line in lines:
        # Continuations are indented, so a line at the margin starts a sentence or a finding ("! ...").
        out += _wrap(line, width, subsequent_indent="  ") or [""]
    return "\n".join(out)


_UNIT_SPACE = re.compile(r"(?<=\d) (?=(?:W|MHz|J/token|J/tok|J|tok/s|s|ms|%|GiB|MiB|tokens?)\b)")


def _wrap(text: str, width: int, subsequent_indent: str = "") -> list[str]:
    """Lines of at most `width` broken between words only; a figure stays on the line of its unit ("150 W")."""
    import textwrap  # noqa: PLC0415

    glued = _UNIT_SPACE.sub("\u00a0", text)  # textwrap breaks only at ASCII whitespace
    return [line.replace("\u00a0", " ") for line in textwrap.wrap(
        glued, width, subsequent_indent=subsequent_indent, break_long_words=False, break_on_hyphens=False)]


def _no_minus_zero(v):
    """0.0 where a percentage rounds to zero at one decimal: a level a hair slower printed -0.0%."""
    return 0.0 if v is not None and round(v, 1) == 0 else v


def _budget(sr: SeriesResult) -> float | None:
    c = sr.choices.get("budget")
    return c.params.get("max_slowdown") if c is not None else None


def _loss(v, sr: SeriesResult) -> str:
    """A level's speed loss (%) with the digits that keep it on its side of the slowdown budget (loss_text: 10.0396%
    read "10.0%" beside "≤ 10% slower", the level over it), never -0.0; "–" unknown."""
    if v is None or not np.isfinite(v):
        return "–"
    text = loss_text(v, _budget(sr))
    return text[1:] if text.startswith("-") and float(text) == 0 else text


_HEAD = f"{'level':>8}  {'tok/s':>7}  {'J/token':>8}  {'±CI%':>5}  {'slower':>7}  {'saving':>7}  "


def _level_rows(sr, width: int | None) -> list[str]:
    """The levels as a fixed-column table, its last column (chosen by, then flags) wrapped under itself
    after a comma; narrower than the figures and the longest policy or flag, one paragraph per level."""
    u = _unit(sr)
    # The table's `recommended` stays the policy's; the mark follows the words (none where they say to keep the reference).
    rows = [dict(r, recommended=r["recommended"] and sr.starred) for r in sr.table.to_pylist()]
    fixed, tails = [], []
    for r in rows:
        fixed.append(f"{r['level_value']:>6g} {u:<2}{'*' if r['recommended'] else ' '}{_f(r['decode_tok_s'], '7.1f'):>7}  "
                     f"{_f(r['gpu_j_per_token'], '8.3f'):>8}  {_f(r['ci_reached_pct'], '5.1f'):>5}  "
                     f"{_loss(r['speed_loss_pct'], sr):>6}%  "
                     f"{_f(_no_minus_zero(r['energy_saving_pct']), '6.1f'):>6}%  ")
        # "(ref)" as the sweep's end table marks it: every loss and saving is against that level.
        tails.append(("(ref)" + ("  " if r["chosen_by"] else "") if r.get("reference") else "") + (r["chosen_by"] or "") + ("  [" + r["flags"] + "]" if r["flags"] else "")
                     + (f"  [{_never_chosen(r)}]" if _never_chosen(r) else ""))
    if width is None:
        return [_HEAD + "chosen by"] + [f + t for f, t in zip(fixed, tails)]
    words = [w for t in tails for w in t.replace(",", ", ").split()]
    if len(_HEAD) + max([len("chosen by")] + [len(w) for w in words]) <= width:
        lines = [(_HEAD + "chosen by").rstrip()]
        for f, t in zip(fixed, tails):
            # Break after a comma: "min_energy,budget,edp" folds at its commas, never inside a name.
            parts = _wrap(t.replace(",", ", "), width - len(_HEAD)) or [""]
            lines += [(f + parts[0].replace(", ", ",")).rstrip()]
            lines += [" " * len(_HEAD) + p.replace(", ", ",") for p in parts[1:]]
        return lines
    out = []
    for r in rows:
        p = (f"{r['level_value']:g} {u}{' *' if r['recommended'] else ''}: {_f(r['decode_tok_s'], '.1f')} tok/s, "
             f"{_f(r['gpu_j_per_token'], '.3f')} J/token ±{_f(r['ci_reached_pct'], '.1f')}%, "
             f"{_loss(r['speed_loss_pct'], sr)}% slower, "
             f"{_f(_no_minus_zero(r['energy_saving_pct']), '.1f')}% saving" + (" (ref)" if r.get("reference") else ""))
        if r["chosen_by"]:
            p += "; chosen by " + r["chosen_by"].replace(",", ", ")
        if r["flags"]:
            p += "; flags: " + r["flags"].replace(",", ", ")
        if _never_chosen(r):
            p += "; " + _never_chosen(r)
        out += _wrap(p, width, subsequent_indent="  ")
    return out


def _levels_summary(result: AnalysisResult, table: bool, width: int | None = None) -> str:
    sr = result.main
    rows = (_level_rows(sr, width) + [""]) if table else []
    if rows and (sr.series.concurrency > 1 or len(result.series) > 1):
        # The series the table is, as the report's heading says it: a lone concurrency-4 series was a bare table.
        rows.insert(0, _wrapped([f"{sr.label.capitalize()} (reference {sr.series.reference_value:g} {_unit(sr)}"
                                 f"{'; tok/s of the streams together' if sr.series.concurrency > 1 else ''}):"], width))
    lines = [recommendation_line(result)]
    if sr.comparable:
        others = [f"{p} {c.level_value:g} {_unit(sr)}" for p, c in sr.choices.items() if p != sr.primary]  # "edp 180" had no unit
        lines.append("Other policies: " + ", ".join(others) + ".")
    if len(result.series) > 1:
        lines.append("Other series: " + "; ".join(
            f"{s.label}: {s.recommendation.level_value:g} {_unit(s)}" if s.starred else
            f"{s.label}: none shown to save energy (keep {s.series.reference_value:g} {_unit(s)})" if s.comparable else
            f"{s.label}: one level, none chosen"
            for s in result.series if s is not sr) + ".")
    for w in result.warnings:
        lines.append(f"! {w.kind}: {w.message}")
    if result.files.get("report.html"):
        lines.append(f"Report: {result.files['report.html']}")
    return "\n".join(rows + [_wrapped(lines, width)])
