"""What `analyze` pools, and what it refuses to: runs that measured another thing are never one level's windows."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from powerprof.analysis.loading import AnalysisError
from powerprof.analysis.report import analyze_run
from powerprof.cli import main
from synthetic_runs import make_run, seed_truth

LEVELS = (180, 220, 260, 300)


def _edit_meta(run, **changes):
    p = run / "run.json"
    meta = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    p.write_text(json.dumps(meta))


def _edit_windows(run, **columns):
    """Replace windows.parquet columns: a value for every row, or a function of the old column."""
    w = pq.read_table(run / "windows.parquet")
    for name, v in columns.items():
        old = w.column(name)
        new = v(old) if callable(v) else pa.array([v] * w.num_rows, old.type)
        w = w.set_column(w.column_names.index(name), name, new)
    pq.write_table(w, run / "windows.parquet")


def _gpus(n, name):
    return [{"index": i, "uuid": f"GPU-{i}", "name": name} for i in range(n)]


def _refused_then_forced(runs, tmp_path, what: str):
    """The pool is refused naming `what`, nothing written; --force pools it with a forced-pool warning naming it."""
    tmp_path.mkdir(exist_ok=True)  # --out's parent: never made by analyze (storage.runs.missing_parent)
    with pytest.raises(AnalysisError, match=what) as e:
        analyze_run(runs, tmp_path / "refused", n_boot=200, plots=False)
    assert "--force" in str(e.value) and not (tmp_path / "refused").exists()
    res = analyze_run(runs, tmp_path / "forced", force=True, n_boot=200, plots=False, formats=())
    assert any(w.kind == "forced-pool" and what in w.message for w in res.warnings), [w.message for w in res.warnings]
    return res


def test_runs_on_different_gpu_counts_are_refused_unless_forced(tmp_path):
    # A sweep on two GPUs (tensor parallel) stores the energy of both: pooled with a one-GPU sweep of the same
    # card, each level's median J/token was neither (220 W: 4.02 J/token, where one GPU's is 2.69 and two
    # GPUs' 5.38), recommended without a word.
    truth = seed_truth()
    two = dataclasses.replace(truth, power_w=lambda L: 2 * truth.power_w(L))
    a = make_run(tmp_path / "one", truth, levels=LEVELS, n_requests=12, seed=1)
    b = make_run(tmp_path / "two", two, levels=LEVELS, n_requests=12, seed=2)
    _edit_meta(a, gpus=_gpus(1, truth.gpu_name))
    _edit_meta(b, gpus=_gpus(2, truth.gpu_name))
    _refused_then_forced([a, b], tmp_path, "GPU count")
    # The same count on both is pooled as before.
    _edit_meta(b, gpus=_gpus(1, truth.gpu_name))
    analyze_run([a, b], tmp_path / "same", n_boot=200, plots=False, formats=())


def test_runs_of_different_request_settings_are_refused_unless_forced(tmp_path):
    a = make_run(tmp_path / "a", seed_truth(), levels=LEVELS, n_requests=8, seed=1)
    b = make_run(tmp_path / "b", seed_truth(), levels=LEVELS, n_requests=8, seed=2)
    _edit_meta(a, params={"max_tokens": 128, "ignore_eos": True, "prompt_cache": False, "temperature": 0.0})
    _edit_meta(b, params={"max_tokens": 512, "ignore_eos": True, "prompt_cache": False, "temperature": 0.0})
    res = _refused_then_forced([a, b], tmp_path, "max_tokens")
    assert all(x in res.warnings[0].message for x in ("128", "512"))


def test_runs_of_different_prompt_sets_are_refused_unless_forced(tmp_path):
    # The prompt set is not in an older run.json; the windows say it: other prompt ids, or the same ids
    # (line-1, line-2 of two --prompts files) with other prompt lengths.
    a = make_run(tmp_path / "a", seed_truth(), levels=LEVELS, n_requests=8, seed=1)
    b = make_run(tmp_path / "b", seed_truth(), levels=LEVELS, n_requests=8, seed=2)
    _edit_windows(b, prompt_id=lambda c: pc.binary_join_element_wise("long-", c, ""))
    _refused_then_forced([a, b], tmp_path / "ids", "prompt")
    _edit_windows(b, prompt_id=lambda c: pc.utf8_replace_slice(c, 0, 5, ""))  # the ids back: p0..p3
    assert set(pq.read_table(b / "windows.parquet").column("prompt_id").to_pylist()) == {"p0", "p1", "p2", "p3"}
    analyze_run([a, b], tmp_path / "same", n_boot=200, plots=False, formats=())
    _edit_windows(b, prompt_tokens=2000)
    _refused_then_forced([a, b], tmp_path / "tokens", "prompt")


def test_runs_whose_run_json_names_other_prompt_sets_are_refused_unless_forced(tmp_path):
    # Two --prompts files with the same ids and prompt lengths (other texts) left the same windows: they were pooled
    # as one prompt set. run.json's prompt_set hash tells them apart; a run without it falls back to the windows.
    a = make_run(tmp_path / "a", seed_truth(), levels=LEVELS, n_requests=8, seed=1)
    b = make_run(tmp_path / "b", seed_truth(), levels=LEVELS, n_requests=8, seed=2)
    _edit_meta(a, prompt_set={"sha256": "1" * 64, "prompts": 4})
    _edit_meta(b, prompt_set={"sha256": "2" * 64, "prompts": 4})
    res = _refused_then_forced([a, b], tmp_path / "hash", "prompt set")
    assert "111111111111" in res.warnings[0].message and "222222222222" in res.warnings[0].message
    _edit_meta(b, prompt_set={"sha256": "1" * 64, "prompts": 4})
    analyze_run([a, b], tmp_path / "same", n_boot=200, plots=False, formats=())
    # An older run (no prompt_set) beside a new one: today's inference from the windows, which agree here...
    _edit_meta(b, prompt_set=None)
    analyze_run([a, b], tmp_path / "older", n_boot=200, plots=False, formats=())
    # ...and refuse where they differ.
    _edit_windows(b, prompt_tokens=2000)
    _refused_then_forced([a, b], tmp_path / "older-tokens", "prompt")


def test_runs_of_different_servers_are_refused_unless_forced(tmp_path):
    # One model file served by llama.cpp and by vLLM: another engine, another J/token curve.
    a = make_run(tmp_path / "a", seed_truth(), levels=LEVELS, n_requests=8, seed=1)
    b = make_run(tmp_path / "b", seed_truth(), levels=LEVELS, n_requests=8, seed=2)
    _edit_windows(a, server_kind="llamacpp")
    _edit_windows(b, server_kind="vllm")
    _refused_then_forced([a, b], tmp_path / "engine", "server engine")
    # One engine, another build (b4500 decodes at another speed than b3000) or other slots (-np 1 and -np 4).
    _edit_windows(b, server_kind="llamacpp")
    _edit_meta(a, server={"kind": "llamacpp", "build_info": "b3000-abc", "total_slots": 1})
    _edit_meta(b, server={"kind": "llamacpp", "build_info": "b4500-def", "total_slots": 1})
    _refused_then_forced([a, b], tmp_path / "build", "server build")
    _edit_meta(b, server={"kind": "llamacpp", "build_info": "b3000-abc", "total_slots": 4})
    _refused_then_forced([a, b], tmp_path / "slots", "server slots")


def test_runs_of_different_energy_methods_are_refused_unless_forced(tmp_path):
    # A card read on its energy counter pooled with one integrated from 1 Hz power: one level's median mixed
    # two sensors whose errors differ 3-30x (docs/collectors.md).
    a = make_run(tmp_path / "a", seed_truth(), levels=LEVELS, n_requests=8, seed=1)
    b = make_run(tmp_path / "b", seed_truth(), levels=LEVELS, n_requests=8, seed=2)
    _edit_windows(b, energy_method="power_integration")
    _refused_then_forced([a, b], tmp_path, "energy method")


def test_a_run_without_run_json_is_not_pooled_unchecked(tmp_path):
    # Its GPU, GPU count and settings are unknown: nothing could refuse a pool with another card.
    a = make_run(tmp_path / "a", seed_truth(), levels=LEVELS, n_requests=8, seed=1)
    b = make_run(tmp_path / "b", seed_truth(), levels=LEVELS, n_requests=8, seed=2)
    (b / "run.json").unlink()
    _refused_then_forced([a, b], tmp_path, "run.json")
    # Alone, a run without run.json is analysed as before.
    analyze_run([b], tmp_path / "alone", n_boot=200, plots=False, formats=())


def test_a_run_without_run_json_is_read_by_its_footer_metadata_and_says_so(tmp_path):
    # Before: a copy without run.json was analysed as a real card's (no "Simulated" banner, exit 0, no word) and
    # advised "Add levels 160 W, 140 W" below the card's 150 W minimum, though every Parquet footer held run.json.
    run = make_run(tmp_path / "run", seed_truth(), levels=(200, 300), n_requests=8, seed=1)
    (run / "run.json").unlink()
    res = analyze_run([run], tmp_path / "out", n_boot=200, plots=False, formats=("md",))
    (info,) = res.runs
    assert info.simulated and info.min_limit_w == seed_truth().min_limit_w and info.meta_from == "windows.parquet"
    (w,) = [w for w in res.warnings if w.kind == "no-run-json"]
    assert str(run) in w.message and "read from windows.parquet's footer metadata" in w.message, w.message
    md = (tmp_path / "out" / "report.md").read_text()
    assert "**Simulated**" in md, md
    edge = [w.message for w in res.warnings if w.kind == "edge"]
    assert edge and not any(f"{v} W" in m for m in edge for v in range(100, 150, 10)), edge
    # Nor a footer: said, not silent.
    t = pq.read_table(run / "windows.parquet")
    pq.write_table(t.replace_schema_metadata(None), run / "windows.parquet")
    res = analyze_run([run], tmp_path / "bare", n_boot=200, plots=False, formats=())
    assert not res.runs[0].simulated and res.runs[0].meta_from is None
    (w,) = [w for w in res.warnings if w.kind == "no-run-json"]
    assert "no usable footer metadata either" in w.message and "unknown" in w.message, w.message


def test_gpu_plus_cpu_figure_is_left_out_where_only_some_runs_measured_the_cpu(tmp_path):
    # One host could read RAPL, the other not: each level's "GPU + CPU" J/token was the median of the first
    # run's windows only, beside a GPU J/token of both, and in 220 W (only the second run) it was missing.
    a = make_run(tmp_path / "a", seed_truth(), levels=LEVELS, n_requests=8, seed=1)
    b = make_run(tmp_path / "b", seed_truth(), levels=(180, 220, 300), n_requests=8, seed=2)
    _edit_windows(b, cpu_energy_j=None, total_j_per_token=None)
    res = analyze_run([a, b], tmp_path / "out", n_boot=200, plots=False, formats=())
    assert all(r["total_j_per_token"] is None for r in res.table.to_pylist())
    (w,) = [w for w in res.warnings if w.kind == "cpu-energy-partial"]
    assert str(b) in w.message and "GPU + CPU" in w.message
    # Both with RAPL: the figure is there.
    res = analyze_run([a], tmp_path / "a-only", n_boot=200, plots=False, formats=())
    assert all(r["total_j_per_token"] > r["gpu_j_per_token"] for r in res.table.to_pylist())


def test_cli_pooling_refusal_exits_1_and_writes_nothing(tmp_path):
    a = make_run(tmp_path / "a", seed_truth(), levels=LEVELS, n_requests=6, seed=1)
    b = make_run(tmp_path / "b", seed_truth(), levels=LEVELS, n_requests=6, seed=2)
    _edit_meta(a, gpus=_gpus(1, seed_truth().gpu_name))
    _edit_meta(b, gpus=_gpus(2, seed_truth().gpu_name))
    r = CliRunner().invoke(main, ["analyze", str(a), str(b), "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "GPU count" in r.output and "--force" in r.output, r.output
    assert not (tmp_path / "o").exists()


def test_levels_not_measured_by_every_pooled_run_are_said(tmp_path):
    # Run a swept 220 and 300 W, run b (another card of the model, drawing 5% more) 180 and 220 W: 180 W's saving was
    # against a's 300 W, so it carried the cards' difference (-5 pp) as if it were the limit's, and nothing said so.
    truth = seed_truth()
    hungry = dataclasses.replace(truth, power_w=lambda L: 1.05 * truth.power_w(L))
    a = make_run(tmp_path / "a", truth, levels=(220, 300), n_requests=10, seed=1)
    b = make_run(tmp_path / "b", hungry, levels=(180, 220), n_requests=10, seed=2)
    res = analyze_run([a, b], tmp_path / "o", n_boot=200, plots=False, formats=())
    (w,) = [w for w in res.warnings if w.kind == "uneven-pool"]
    assert w.levels == (180.0, 300.0) and f"180 W only in {b}" in w.message and f"300 W only in {a}" in w.message
    # Every run at every level: nothing to say.
    c = make_run(tmp_path / "c", truth, levels=(220, 300), n_requests=10, seed=3)
    res = analyze_run([a, c], tmp_path / "o2", n_boot=200, plots=False, formats=())
    assert not [w for w in res.warnings if w.kind == "uneven-pool"]


def test_draft_counts_pooled_over_runs_are_summed_and_their_acceptance_is_the_sums_ratio(tmp_path):
    # Averaged like a sensor figure, 1000/900 and 101/10 drafts read 550/455 (the mean truncated to an integer) and an
    # acceptance of 0.4995, a mean of ratios, where the level proposed 1101 and accepted 910 (session 46's review).
    from types import SimpleNamespace

    from powerprof.analysis.loading import sweep_level_figures

    runs = []
    for k, (n, a) in enumerate(((1000, 900), (101, 10))):
        d = tmp_path / f"r{k}"
        d.mkdir()
        pq.write_table(pa.table({"level_kind": ["power_limit"], "level_value": [200.0], "draft_n": pa.array([n], pa.int64()),
                                 "draft_n_accepted": pa.array([a], pa.int64()), "draft_acceptance": [a / n],
                                 "draft_source": ["timings"]}), d / "levels.parquet")
        runs.append(SimpleNamespace(path=d))
    got = sweep_level_figures(runs)[("power_limit", 200.0, 1)]  # keyed by concurrency too (no column: 1)
    assert got["draft_n"] == 1101 and got["draft_n_accepted"] == 910, got
    assert got["draft_acceptance"] == pytest.approx(910 / 1101) and got["draft_source"] == "timings"


def test_every_flushs_footer_says_the_levels_its_rows_finished(tmp_path, monkeypatch):
    # The footers were written before run.json's levels_done of the same flush: one flush behind their own rows. A run
    # killed there (SIGKILL, out of memory) and analysed from its footer without run.json said a finished level was
    # interrupted, and recommended another (the review: 250 W finished, "interrupted", 300 W recommended).
    import powerprof.sweep as sweep_mod

    out, seen, orig = tmp_path / "run", [], sweep_mod.Sweep.flush

    def flush(self):
        orig(self)
        said = json.loads((out / "run.json").read_text()).get("levels_done")
        for name in ("windows", "samples", "levels"):
            seen.append((said, json.loads(pq.read_schema(out / f"{name}.parquet").metadata[b"powerprof"]).get("levels_done")))

    monkeypatch.setattr(sweep_mod.Sweep, "flush", flush)
    r = CliRunner().invoke(main, ["sweep", "--simulate", "--limits", "200,300", "--idle-s", "0", "--min-requests", "2",
                                  "--max-requests", "2", "--warmup", "0", "--max-tokens", "16", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert seen and all(a == b for a, b in seen), seen


@pytest.mark.parametrize("footer", [b'{"settings": "x", "gpus": []}', b"[" * 200000 + b"]" * 200000])
def test_an_unusable_footer_is_no_refusal_whose_fix_cannot_be_followed(tmp_path, footer):
    # A footer of the wrong shape refused the run, its fix "restore run.json, or move it aside" (there was none to move),
    # and one nested past Python's stack was a RecursionError traceback; the run analysed before the footer was read.
    from powerprof.analysis.loading import read_run_info

    run = make_run(tmp_path / "run", seed_truth(), levels=(200, 300), n_requests=8, seed=1)
    (run / "run.json").unlink()
    t = pq.read_table(run / "windows.parquet")
    pq.write_table(t.replace_schema_metadata({**(t.schema.metadata or {}), b"powerprof": footer}), run / "windows.parquet")
    info = read_run_info(run)
    assert info.meta_from is None and info.meta == {}, info



def test_a_forced_pool_says_a_footer_read_runs_facts_were_read_not_unknown(tmp_path):
    # The refusal said a run without run.json had its GPU, count and settings unknown, beside the no-run-json warning
    # saying they were read from the footer (the review): now it says where they came from.
    a = make_run(tmp_path / "a", seed_truth(), levels=(200, 300), n_requests=8, seed=1)
    b = make_run(tmp_path / "b", seed_truth(), levels=(200, 300), n_requests=8, seed=2)
    (b / "run.json").unlink()
    with pytest.raises(AnalysisError, match="read from windows.parquet's footer metadata"):
        analyze_run([a, b], tmp_path / "o1", n_boot=200, plots=False, formats=())
    res = analyze_run([a, b], tmp_path / "out", n_boot=200, plots=False, formats=(), force=True)
    said = [f"{w.kind}: {w.message}" for w in res.warnings]
    assert not any("are unknown" in x for x in said), said
