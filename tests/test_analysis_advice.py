"""Advice the analysis gives: wide-CI warnings name the limit that stopped the level and the run's own
CI target; the recommendation line does not pass off the whole measured range as a confident range."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from powerprof.analysis.analyze import AnalysisResult
from powerprof.analysis.checks import level_findings
from powerprof.analysis.report import analyze_run, recommendation_line
from synthetic_runs import make_run, seed_truth
from powerprof.storage.schema import LEVELS


def _levels(**row) -> pa.Table:
    base = {"level_kind": "power_limit", "level_value": 200.0, "n_requests": 20, "ci_reached_pct": 4.0,
            "flags": "wide-ci"}
    base.update(row)
    return pa.Table.from_pylist([base], schema=LEVELS)


def _wide(findings) -> str:
    (f,) = [f for f in findings if f.kind == "wide-ci"]
    return f.message


def test_max_time_stop_suggests_a_longer_max_time_from_the_rate_achieved():
    # 20 requests in 60 s (1/3 request/s) reached ±4%; ±2% needs (4/2)^2 x 20 = 80 requests = 240 s.
    msg = _wide(level_findings(_levels(stop_rule="max-time"), target_ci_pct=2.0, max_time_s=60.0, max_requests=200))
    assert "--max-time 240" in msg and "80 requests" in msg and "0.33 requests/s" in msg
    assert "--max-requests" not in msg  # 80 fit under the run's --max-requests 200


def test_max_time_advice_counts_every_visit_of_the_level():
    # Two repeats of 60 s gathered the 20 requests: 1/6 request/s; 80 requests still need 240 s per visit.
    msg = _wide(level_findings(_levels(stop_rule="max-time"), target_ci_pct=2.0, max_time_s=60.0, repeats=2))
    assert "--max-time 240" in msg and "0.17 requests/s" in msg


def test_max_time_advice_also_raises_max_requests_when_it_would_bind_next():
    msg = _wide(level_findings(_levels(stop_rule="max-time"), target_ci_pct=2.0, max_time_s=60.0, max_requests=50))
    assert "--max-time 240" in msg and "--max-requests 80" in msg


def test_max_requests_stop_suggests_max_requests_at_the_runs_target():
    # Target ±1%: (4/1)^2 x 20 = 320 requests.
    msg = _wide(level_findings(_levels(stop_rule="max-requests"), target_ci_pct=1.0, max_time_s=60.0))
    assert "--max-requests 320" in msg and "±1%" in msg and "--max-time" not in msg


def test_without_settings_or_stop_rule_the_advice_falls_back_to_two_percent():
    msg = _wide(level_findings(_levels()))
    assert "±2%" in msg and "--max-requests 80" in msg


def test_target_reached_by_the_sweep_suggests_min_requests():
    msg = _wide(level_findings(_levels(stop_rule="ci-reached"), target_ci_pct=2.0))
    assert "--min-requests 80" in msg and "--max-requests" not in msg


def test_analyze_reads_stop_rule_and_settings_from_the_run(tmp_path):
    run = make_run(tmp_path / "run", seed_truth(), levels=(200, 240, 280), n_requests=5, noise=0.08)
    levels = pq.read_table(run / "levels.parquet")
    levels = levels.set_column(levels.schema.get_field_index("stop_rule"), "stop_rule",
                               pa.array(["max-time"] * levels.num_rows, pa.string()))
    pq.write_table(levels, run / "levels.parquet")
    meta = json.loads((run / "run.json").read_text())
    meta["settings"] = {"target_ci": 0.05, "max_time_s": 30.0, "max_requests": 200, "repeats": 1}
    (run / "run.json").write_text(json.dumps(meta))
    res = analyze_run([run], tmp_path / "out", n_boot=300, plots=False)
    wide = [w for w in res.warnings if w.kind == "wide-ci"]
    assert wide, "8% noise over 5 requests leaves some level's CI wider than ±5%"
    for w in wide:
        assert "±5%" in w.message and "--max-time " in w.message and "--max-requests" not in w.message
    assert set(res.table.column("stop_rule").to_pylist()) == {"max-time"}


@pytest.fixture(scope="module")
def seed_result(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("seed") / "run", seed_truth(), levels=(180, 220, 260, 300),
                   n_requests=40)
    return analyze_run([run], n_boot=300, plots=False)


def _with_range(res: AnalysisResult, lo: float, hi: float) -> AnalysisResult:
    sr = res.main
    choices = dict(sr.choices)
    choices[sr.primary] = dataclasses.replace(choices[sr.primary], ci_low=lo, ci_high=hi)
    return dataclasses.replace(res, series=[dataclasses.replace(sr, choices=choices)])


def test_recommendation_line_keeps_a_range_narrower_than_the_levels(seed_result):
    line = recommendation_line(_with_range(seed_result, 220.0, 260.0))
    assert "95% of resamples choose 220–260 W." in line and "uncertain" not in line


def test_recommendation_line_calls_a_whole_range_choice_uncertain(seed_result):
    line = recommendation_line(_with_range(seed_result, 180.0, 300.0))
    assert "uncertain choice" in line and "more requests per level would settle it" in line
    assert "95% of resamples choose" not in line


def test_wide_ci_over_repeated_prompts_says_more_rounds_speak_for_these_prompts_only():
    (f,) = [f for f in level_findings(_levels(stop_rule="max-time", n_prompts=4), target_ci_pct=2.0, max_time_s=60.0)
            if f.kind == "few-prompts"]
    assert "200 W repeat 4 distinct prompts" in f.message and "--prompt-set mixed" in f.message
    # As many distinct prompts as requests: nothing repeats, no such advice.
    assert not [f for f in level_findings(_levels(stop_rule="max-time", n_prompts=20), target_ci_pct=2.0)
                if f.kind == "few-prompts"]


def test_levels_count_the_distinct_prompts_a_sweep_repeated():
    from powerprof.analysis.stats import summarize_levels

    rows = []
    for level in (220.0, 300.0):
        for rnd in range(3):
            for p in ("a", "b"):
                rows.append({"window_kind": "request", "warmup": False, "status": "ok", "level_kind": "power_limit",
                             "level_value": level, "concurrency": 1, "prompt_id": p, "decode_tok_s": 80.0 + rnd,
                             "gpu_j_per_token": 3.0 + 0.01 * rnd, "gpu_energy_j": 300.0 + rnd, "decode_tokens": 100,
                             # figures that agree with their parts (stats.impossible_reasons leaves others out)
                             "decode_s": 100 / (80.0 + rnd), "energy_method": "counter"})
    levels = summarize_levels(pa.Table.from_pylist(rows), reference_value=300.0, n_boot=50).to_pylist()
    assert [(r["level_value"], r["n_requests"], r["n_prompts"]) for r in levels] == [(220.0, 6, 2), (300.0, 6, 2)]


def test_windows_a_sweep_could_not_store_are_said_out_loud(tmp_path):
    run = make_run(tmp_path / "run", seed_truth())
    meta = json.loads((run / "run.json").read_text())
    meta.update(unstored_window_rows=2, unstored_error="tokens_predicted: value too large for int32")
    (run / "run.json").write_text(json.dumps(meta))
    result = analyze_run([str(run)], str(tmp_path / "out"), formats=("md",))
    unstored = [f for f in result.warnings if f.kind == "unstored"]
    assert len(unstored) == 1 and "2 measured window row(s) could not be stored" in unstored[0].message
    assert "computed without them" in (tmp_path / "out" / "report.md").read_text()


def _mixed_host_run(tmp_path, name, gpus) -> "Path":
    run = make_run(tmp_path / name, seed_truth(), levels=(180, 220, 260, 300), n_requests=8)
    meta = json.loads((run / "run.json").read_text())
    for k in ("min_limit_w", "max_limit_w", "default_limit_w"):
        meta.pop(k, None)
    meta["gpus"] = gpus
    (run / "run.json").write_text(json.dumps(meta))
    return run


def _advice(res):
    choices = {p: c.recommended_value for s in res.series for p, c in s.choices.items()}
    return choices, {w.kind: " ".join(w.message.split()) for w in res.warnings}


def test_the_advice_uses_the_range_of_the_gpus_that_took_the_levels_on_a_mixed_host(tmp_path):
    # run.json lists GPU 0 an L4 (40-72 W) and GPU 1 the card the levels were measured on (150-320 W). The range the
    # advice clips to was GPU 0's alone: every policy recommended 72 W (a level never measured, that the measured card
    # does not accept), "measure 72 W to confirm", and "add 140 W (the card accepts down to 40 W)" below GPU 1's floor.
    t = seed_truth()
    clean = _advice(analyze_run([make_run(tmp_path / "clean", t, levels=(180, 220, 260, 300), n_requests=8)],
                                tmp_path / "o-clean", n_boot=200, plots=False, formats=()))
    run = _mixed_host_run(tmp_path, "mixed", [
        {"index": 0, "name": "NVIDIA L4", "min_limit_w": 40.0, "max_limit_w": 72.0, "default_limit_w": 72.0},
        {"index": 1, "name": t.gpu_name, "min_limit_w": t.min_limit_w, "max_limit_w": t.max_limit_w,
         "default_limit_w": t.default_limit_w}])
    choices, said = _advice(analyze_run([run], tmp_path / "o", n_boot=200, plots=False, formats=()))
    assert choices == clean[0]
    assert said["edge"] == clean[1]["edge"] and said["between-levels"] == clean[1]["between-levels"], said
    # GPU 0's range holds none of the levels: left out of the advice, and said.
    assert "GPU 0 (NVIDIA L4)" in said["card-range"] and "40-72 W" in said["card-range"], said["card-range"]


def test_the_advice_uses_the_limits_every_gpu_of_the_run_accepts(tmp_path):
    # Two cards whose ranges overlap: a sweep sets one level on both, so a level to add must be one both accept.
    # GPU 0's floor alone (100 W) let the advice add 160 W and 140 W, where GPU 1 takes nothing under 170 W.
    t = seed_truth()
    run = _mixed_host_run(tmp_path, "mixed", [
        {"index": 0, "name": "card A", "min_limit_w": 100.0, "max_limit_w": 320.0, "default_limit_w": 300.0},
        {"index": 1, "name": "card B", "min_limit_w": 170.0, "max_limit_w": 350.0, "default_limit_w": 300.0}])
    _, said = _advice(analyze_run([run], tmp_path / "o", n_boot=200, plots=False, formats=()))
    assert "Add level 170 W" in said["edge"] and "every GPU of the run accepts down to 170 W" in said["edge"], said
    assert "card-range" not in said


def _one_window(findings) -> str:
    (f,) = [f for f in findings if f.kind == "one-window"]
    return " ".join(f.message.split())


def test_one_window_says_why_the_level_has_one_and_the_fix_that_fits(tmp_path):
    # A copy of a sweep (no trace) where 3 of 4 windows at 260 W failed said "one measured window at 260 W (a trace
    # replayed once per level)… the recommendation no resampling spread; replay each level more than once (--repeats
    # 3)", beside "95% of resamples choose 220–260 W": the wrong cause, a spread that was there, a fix for traces.
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 260, 300), n_requests=4, n_failed=0)
    t = pq.read_table(run / "windows.parquet")
    rows = t.to_pylist()
    seen = 0
    for r in rows:
        if r["level_value"] == 260.0 and not r["warmup"]:
            seen += 1
            if seen > 1:
                r["status"] = "failed"
    pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), run / "windows.parquet")
    res = analyze_run([run], out_dir=tmp_path / "a", n_boot=200, plots=False)
    msg = _one_window(res.warnings)
    assert msg.startswith("one measured window at 260 W (3 of its 4 requests failed)"), msg
    assert "trace" not in msg and "--repeats" not in msg and "no resampling spread" not in msg, msg
    assert "failed" in msg and "--min-requests" in msg, msg
    # Every level one window, no trace: the choice's line says there is no spread and points at the warning, never
    # at --repeats (a trace's fix; it told every such run to replay each level).
    seen = {}
    for r in rows:
        if not r["warmup"]:
            seen[r["level_value"]] = seen.get(r["level_value"], 0) + 1
            if seen[r["level_value"]] > 1:
                r["status"] = "failed"
    pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), run / "windows.parquet")
    analyze_run([run], out_dir=tmp_path / "b", n_boot=200, plots=False)
    report = " ".join((tmp_path / "b" / "report.md").read_text().split())
    assert "one window per level: no resampling spread" in report and "--repeats" not in report, report
    # Windows left out (not failed), and a level that stopped after one: each its own cause.
    left = _one_window(level_findings(_levels(n_requests=4, n_windows=1, n_failed=0, flags="one-window",
                                              concurrency=1)))
    assert "(3 of its 4 measured requests left out)" in left and "the findings above say why" in left, left
    stopped = _one_window(level_findings(_levels(n_requests=1, n_windows=1, n_failed=0, flags="one-window")))
    assert "(the level stopped after one request)" in stopped and "--max-time" in stopped, stopped
    # A trace replayed once per level: its own cause and fix; no spread where every level has one window.
    trace = _one_window(level_findings(pa.Table.from_pylist(
        [{"level_kind": "power_limit", "level_value": v, "n_requests": 8, "n_windows": 1, "flags": "one-window"}
         for v in (200.0, 300.0)], schema=LEVELS), trace=True))
    assert trace.startswith("one measured window at 200 W, 300 W (a trace replayed once per level)"), trace
    assert "no resampling spread" in trace and "--repeats 3" in trace, trace


def _few_windows(findings) -> str:
    (f,) = [f for f in findings if f.kind == "few-windows"]
    return " ".join(f.message.split())


def test_few_windows_names_the_fix_each_levels_stop_rule_calls_for():
    # `sweep --max-requests 4 --min-requests 2`: both levels stopped on --max-requests, yet the fix said "a longer
    # --max-time (the level stopped on its time budget), or --min-requests 5 or more" (refused beside --max-requests 4).
    def rows(**kw):
        return pa.Table.from_pylist([{"level_kind": "power_limit", "level_value": v, "n_requests": 4, "n_windows": 4,
                                      "concurrency": 1, "flags": "few-windows", **kw} for v in (180.0, 300.0)],
                                    schema=LEVELS)

    capped = _few_windows(level_findings(rows(stop_rule="max-requests"), max_requests=4, max_time_s=5.0))
    assert "--max-time" not in capped and "time budget" not in capped, capped
    assert "180 W, 300 W stopped at --max-requests 4: raise it to 5 or more" in capped, capped
    timed = _few_windows(level_findings(rows(stop_rule="max-time"), max_requests=40, max_time_s=5.0))
    assert "stopped on --max-time 5 s: a longer --max-time" in timed and "--min-requests 5" in timed, timed
    cut = _few_windows(level_findings(rows(stop_rule=None, flags="few-windows,interrupted")))
    assert "interrupted: let the level finish" in cut and "--max-time" not in cut, cut
    # At concurrency 4 a window is a batch: 5 windows take about 20 requests.
    batched = _few_windows(level_findings(pa.Table.from_pylist(
        [{"level_kind": "power_limit", "level_value": 200.0, "n_requests": 8, "n_windows": 2, "concurrency": 4,
          "flags": "few-windows", "stop_rule": "max-requests"}], schema=LEVELS), max_requests=8))
    assert "raise it to about 20 or more" in batched, batched


def test_a_level_whose_j_per_token_rests_on_one_of_its_windows_is_one_window_with_no_ci(tmp_path):
    # A sweep behind a buffering hop costed 3 of 4 windows a level with no energy (energy_method none): the level's
    # J/token was its one window's, flagged few-windows alone (n_windows 4), and analyze printed its CI as ±0.0%.
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 260, 300), n_requests=4, n_failed=0)
    t = pq.read_table(run / "windows.parquet")
    rows = t.to_pylist()
    seen = 0
    for r in rows:
        if r["level_value"] == 260.0 and not r["warmup"] and r["window_kind"] == "request":
            seen += 1
            if seen > 1:
                r.update(gpu_energy_j=None, gpu_j_per_token=None, total_j_per_token=None, energy_method="none",
                         above_idle_gpu_j_per_token=None, avg_gpu_power_w=None)
    pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), run / "windows.parquet")
    res = analyze_run([run], out_dir=tmp_path / "a", n_boot=200, plots=False, formats=())
    lv = {r["level_value"]: r for r in res.table.to_pylist()}
    at = lv[260.0]
    # n_windows counts the windows its J/token rests on; the 3 with a rate alone are counted apart.
    assert at["n_windows"] == 1 and at["n_windows_tok_s_only"] == 3, at
    assert lv[220.0]["n_windows"] == 4 and lv[220.0]["n_windows_tok_s_only"] == 0, lv[220.0]
    assert "one-window" in at["flags"].split(",") and "few-windows" not in at["flags"], at
    assert at["gpu_j_per_token"] > 0
    assert at["gpu_j_per_token_ci_low"] is None or at["gpu_j_per_token_ci_low"] != at["gpu_j_per_token_ci_low"], at
    assert at["decode_tok_s_ci_low"] == at["decode_tok_s_ci_low"]  # its rate rests on all 4: its CI stays
    msg = _one_window(res.warnings)
    assert msg.startswith("one window with a J/token at 260 W (its J/token rests on 1 of its 4 measured windows"), msg
    assert "energy_method none" in msg and "notes say why" in msg and "left out" not in msg, msg


def test_a_levels_window_count_is_the_windows_its_j_per_token_rests_on(tmp_path):
    # 8 windows at 260 W, 5 of them with no energy (energy_method none): levels.parquet said n_windows 8 beside a
    # J/token and CI resting on 3, and the few-windows finding said "fewer than 5 measured windows (260 W: 8)" and
    # "99.2188% at 8" where the CI of 3 windows covers 75%. n_windows is now the 3; the 5 timed alone are
    # n_windows_tok_s_only.
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 260, 300), n_requests=8, n_failed=0)
    t = pq.read_table(run / "windows.parquet")
    rows = t.to_pylist()
    seen = 0
    for r in rows:
        if r["level_value"] == 260.0 and not r["warmup"] and r["window_kind"] == "request":
            seen += 1
            if seen > 3:
                r.update(gpu_energy_j=None, gpu_j_per_token=None, total_j_per_token=None, energy_method="none",
                         above_idle_gpu_j_per_token=None, avg_gpu_power_w=None)
    pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), run / "windows.parquet")
    res = analyze_run([run], out_dir=tmp_path / "a", n_boot=200, plots=False, formats=())
    at = {r["level_value"]: r for r in res.table.to_pylist()}[260.0]
    assert at["n_windows"] == 3 and at["n_windows_tok_s_only"] == 5, at
    assert "few-windows" in at["flags"].split(","), at
    msg = _few_windows(res.warnings)
    assert "(260 W: 3)" in msg and "75% at 3" in msg and "at 8" not in msg, msg
