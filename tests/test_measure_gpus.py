"""`powerprof measure` on several GPUs: its GPU J/token is the sum over every GPU it reads, and it says GPU by GPU
what that sum is made of (printed under the table, run.json `per_gpu`, --json `gpus`), each part matching the
simulator's truth for that GPU, on a host of one kind and on a mixed one."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.workload.client import RequestParams
from powerprof.workload.load import Prompt


def _measure(rig, out, **kw):
    from powerprof.workload.measure import run_measure

    kw = dict(url=None, out_dir=out, prompts=[Prompt("p0", "hello there"), Prompt("p1", "tell me more")],
              n_requests=4, concurrencies=[1, 2], params=RequestParams(max_tokens=128), warmup=1, interval_s=0.2) | kw
    return run_measure(rig, **kw)


@pytest.mark.parametrize("profile,count,names", [("h200-141g,l4-24g", 1, ("H200", "L4")),
                                                 ("seed-16g", 2, None)])
def test_measure_says_what_each_gpu_adds_to_its_j_per_token(tmp_path, profile, count, names):
    sim = SimNVML(profile, count=count, state_path=None, record_history=True)
    with Rig(profile, nvml=sim, sim_gpu_count=count) as rig:
        res = _measure(rig, tmp_path / "m")
    recs = {r.request_id: r for r in res.records}
    for x in res.summaries:
        assert x.gpus is not None and [g["index"] for g in x.gpus] == [0, 1], x.gpus
        # The figure is the sum of the parts, each part its GPU's energy over the same windows.
        assert sum(g["gpu_j_per_token"] for g in x.gpus) == pytest.approx(x.gpu_j_per_token, rel=1e-9)
        if names:
            assert all(n in g["name"] for n, g in zip(names, x.gpus)), x.gpus
        if x.concurrency == 1:
            used = [r for r in res.rows if r["window_kind"] == "request" and r["concurrency"] == 1 and not r["warmup"]
                    and r["status"] == "ok" and r["timing"] != "untrusted"]
            tokens = sum(r["decode_tokens"] for r in used)
            for g, gpu in zip(x.gpus, sim.gpus):
                truth = sum(gpu.true_energy_at_j(recs[r["request_id"]].timing.t1_ns)
                            - gpu.true_energy_at_j(recs[r["request_id"]].timing.t0_ns) for r in used) / tokens
                # 5%: the simulated H200's counter refreshes every 100 ms as a real one does, and these windows are
                # under a second (measure flags that: −2.2% pooled at 0.31 s); beside a busy loop one run read −2.1%.
                assert g["gpu_j_per_token"] == pytest.approx(truth, rel=0.05), (g, truth)
    meta = json.loads((tmp_path / "m" / "run.json").read_text())
    assert [p["concurrency"] for p in meta["per_gpu"]] == [1, 2]
    assert meta["per_gpu"][0]["gpus"] == res.summaries[0].gpus
    assert res.to_dict()["concurrencies"][0]["gpus"] == res.summaries[0].gpus


def test_measure_prints_each_gpus_part_on_a_mixed_host_and_not_for_one_gpu(tmp_path):
    from powerprof.cli import main

    r = CliRunner().invoke(main, ["measure", "--simulate", "h200-141g,l4-24g", "--requests", "2", "--max-tokens", "32",
                                  "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    (line,) = [ln for ln in r.output.splitlines() if ln.startswith("concurrency 1: GPU J/token")]
    assert " = GPU 0 (Simulated NVIDIA H200) " in line and " + GPU 1 (Simulated NVIDIA L4) " in line and " W" in line
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g", "--requests", "2", "--max-tokens", "32",
                                  "--out", str(tmp_path / "one")])
    assert r.exit_code == 0 and "GPU J/token" not in r.output, r.output
    meta = json.loads((tmp_path / "one" / "run.json").read_text())
    assert len(meta["per_gpu"][0]["gpus"]) == 1  # one GPU: its part is the whole, stored all the same
