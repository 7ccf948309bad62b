"""`sweep --trace` and `replay` beside others' work: a replay's requests overlap, so the server's books and the GPUs'
processes are compared over the whole replay. A level whose replay ran beside another client's requests or another
process's kernels is flagged foreign-traffic and has no J/token (its energy holds theirs); the other levels keep
theirs, and a quiet server flags nothing. `replay` says so and exits 1."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from powerprof.rig import Rig
from support import busy_sim_server
from powerprof.sim.nvml import SimNVML
from powerprof.sweep import UI, run_sweep
from powerprof.workload.servercount import FOREIGN_FLAG
from powerprof.workload.trace import synthetic, write_jsonl


class _AtLevel(UI):
    """Starts `begin()` as level `value` starts and stops it as that level is done."""

    def __init__(self, value, begin):
        self.value, self.begin, self.it = value, begin, None
        self.notes: list[str] = []

    def level_start(self, i, n, visit, unit):
        if visit.level_value == self.value:
            self.it = self.begin()

    def level_done(self, visit, live):
        if visit.level_value == self.value and self.it is not None:
            self.it.stop()

    def note(self, text):
        self.notes.append(text)


def _trace():
    return synthetic(8, 6.0, prompt_median=20, output_median=48, output_range=(40, 60), seed=4)


class _FirstReplayAt(_AtLevel):
    """Starts `begin()` as level `value` starts and stops it as the sweep says it replays that level once more."""

    def note(self, text):
        self.notes.append(text)
        if "replaying it once more" in text and self.it is not None:
            self.it.stop()


def _trace_sweep(tmp_path, start_at_200, ui_class=_AtLevel, nvml=None):
    """sweep --trace over 300 W then 200 W on a simulated seed card; `start_at_200(rig, url)` runs during level 200."""
    out = tmp_path / "run"
    levels_seen = []
    with Rig("seed-16g", nvml=nvml or SimNVML("seed-16g", state_path=None)) as rig, rig.sim_server() as srv:
        ui = ui_class(200.0, lambda: start_at_200(rig, srv.url))
        outcome = run_sweep(rig, levels_spec="300,200", url=srv.url, trace=_trace(), trace_meta={}, out_dir=out,
                            idle_s=0, interval_s=0.2, ui=ui, on_level=levels_seen.append)
    w = pq.read_table(out / "windows.parquet").to_pylist()
    traces = {r["level_value"]: r for r in w if r["window_kind"] == "trace"}
    levels = {r["level_value"]: r for r in pq.read_table(out / "levels.parquet").to_pylist()}
    return outcome, traces, levels, {lv.level_value: lv for lv in levels_seen}, ui


def _no_figure(levels, value):
    j = levels.get(value, {}).get("gpu_j_per_token")
    return j is None or j != j  # no row, null or NaN: not the biased figure


@pytest.mark.parametrize("who", ["client", "gpu"])
def test_a_replay_beside_others_work_has_no_figure_and_says_why(tmp_path, who):
    def start(rig, url):
        if who == "client":
            return rig.sim_bystander_client(url, max_tokens=32, gap_s=0.2)
        return rig.sim_bystander_gpu(0, power_w=60.0, share=0.3)

    outcome, traces, levels, shown, ui = _trace_sweep(tmp_path, start)
    assert ui.it is not None and (who == "gpu" or ui.it.requests >= 1), getattr(ui.it, "errors", None)
    t200, t300 = traces[200.0], traces[300.0]
    assert t200["foreign_traffic"] and t200["gpu_j_per_token"] is None and t200["decode_tok_s"] is None
    want = "not powerprof's|more than powerprof" if who == "client" else "ran kernels on GPU 0"
    assert any(w in t200["foreign_traffic"] for w in want.split("|")), t200["foreign_traffic"]
    assert t300["foreign_traffic"] is None and t300["gpu_j_per_token"] > 0
    assert FOREIGN_FLAG in (levels[200.0]["flags"] or "").split(","), levels[200.0]["flags"]
    assert _no_figure(levels, 200.0) and levels[300.0]["gpu_j_per_token"] == pytest.approx(t300["gpu_j_per_token"])
    assert FOREIGN_FLAG not in (levels[300.0]["flags"] or "")
    assert shown[200.0].foreign_traffic and shown[200.0].gpu_j_per_token is None and shown[200.0].tok_s is None
    assert shown[300.0].foreign_traffic is None
    said = [n for n in outcome.notes if n.startswith("others' work ran beside the replay")]
    assert len(said) == 1 and "level 200" in said[0] and "level 300" not in said[0] and "fix:" in said[0], outcome.notes
    # Replayed once more (bounded: one retry), beside them again: the note says how to get a clean figure.
    at200 = [t for t in pq.read_table(tmp_path / "run" / "windows.parquet").to_pylist()
             if t["window_kind"] == "trace" and t["level_value"] == 200.0]
    assert len(at200) == 2 and all(t["foreign_traffic"] for t in at200), at200
    assert "both replays" in said[0] and "--repeats" in said[0], said[0]


@pytest.mark.parametrize("who", ["client", "gpu"])
def test_a_level_whose_replay_ran_beside_others_work_is_replayed_once_more_and_keeps_the_clean_figure(tmp_path, who):
    # Before: a level whose replay ran beside others' work was not replayed again: no figure at that level, though
    # the others had gone a moment later (a plain sweep measures such batches again).
    def start(rig, url):
        if who == "client":
            return rig.sim_bystander_client(url, max_tokens=32, gap_s=0.2)
        return rig.sim_bystander_gpu(0, power_w=60.0, share=0.3)

    sim = SimNVML("seed-16g", state_path=None, record_history=True)
    outcome, traces, levels, shown, ui = _trace_sweep(tmp_path, start, _FirstReplayAt, sim)
    assert any("replaying it once more" in n for n in ui.notes), ui.notes
    w = pq.read_table(tmp_path / "run" / "windows.parquet").to_pylist()
    at200 = [r for r in w if r["window_kind"] == "trace" and r["level_value"] == 200.0]
    assert len(at200) == 2, at200
    first, again = at200
    assert first["foreign_traffic"] and first["gpu_j_per_token"] is None
    assert again["foreign_traffic"] is None and again["gpu_j_per_token"] > 0
    # The level's figure is the clean replay's, against the simulated GPU's true energy over it.
    visit = next(v for v in outcome.sweep.visits if v.level_value == 200.0)
    (t0, t1), = visit.spans
    g = sim.gpus[0]
    truth = (g.true_energy_at_j(t1) - g.true_energy_at_j(t0)) / shown[200.0].generated_tokens
    assert shown[200.0].gpu_j_per_token == pytest.approx(truth, rel=0.03)
    assert levels[200.0]["gpu_j_per_token"] == pytest.approx(again["gpu_j_per_token"])
    # Still flagged (a replay was left out), said once in the notes with what happened next.
    assert FOREIGN_FLAG in (levels[200.0]["flags"] or "").split(","), levels[200.0]["flags"]
    assert shown[200.0].foreign_traffic is None and shown[200.0].tok_s > 0
    assert shown[200.0].replayed_again and shown[200.0].replayed_again == first["foreign_traffic"]
    said = [n for n in outcome.notes if n.startswith("others' work ran beside the replay")]
    assert len(said) == 1 and "level 200" in said[0] and "replayed once more" in said[0], outcome.notes
    assert traces[300.0]["foreign_traffic"] is None and len([r for r in w if r["window_kind"] == "trace"]) == 3


def test_a_quiet_server_flags_no_replay(tmp_path):
    outcome, traces, levels, shown, _ = _trace_sweep(tmp_path, lambda rig, url: None)
    assert all(t["foreign_traffic"] is None and t["gpu_j_per_token"] > 0 for t in traces.values()), traces
    assert not any(FOREIGN_FLAG in (lv["flags"] or "") for lv in levels.values())
    assert not any("others' work" in n or "other clients of the server" in n for n in outcome.notes), outcome.notes


def _replay_cli(tmp_path, monkeypatch, busy: bool):
    from powerprof.cli import main

    if busy:
        busy_sim_server(monkeypatch)  # another client on the server for the whole replay
    t = tmp_path / "t.jsonl"
    write_jsonl(synthetic(6, 10.0, prompt_median=20, output_median=16, output_range=(8, 24), seed=1), t)
    return CliRunner().invoke(main, ["replay", str(t), "--simulate", "seed-16g", "--json"])


def test_replay_beside_another_client_says_so_and_exits_1(tmp_path, monkeypatch):
    r = _replay_cli(tmp_path, monkeypatch, busy=True)
    assert r.exit_code == 1, r.output
    out = json.loads(r.stdout)
    assert out["foreign_traffic"]["server_tokens"] > 0 and "fix:" in out["foreign_traffic"]["message"]
    assert out["notes"][0] == out["foreign_traffic"]["message"]
    assert "not the trace's alone" in r.stderr


def test_replay_on_a_quiet_server_flags_nothing(tmp_path, monkeypatch):
    r = _replay_cli(tmp_path, monkeypatch, busy=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["foreign_traffic"] is None and out["ok"] == 6
    assert not any("others' work" in n for n in out["notes"]), out["notes"]
