"""The daemon against clients that leave mid-stream, before the usage that says their prompt's length."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_helpers import DaemonProc, read_dataset, sim_env
from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer, count_prompt_tokens
from powerprof.storage.schema import BYPASS_LOW_FLAG, PROMPT_UNREAD_FLAG

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import cut_accuracy  # noqa: E402

pytestmark = pytest.mark.slow


def _seed_server(flavour: str) -> SimServer:
    """A simulated server on a 16 GB card, 80 tok/s, no drafts (its speed fixes where a cut lands)."""
    return SimServer(SimNVML("seed-16g", state_path=None), flavour=flavour, decode_tok_s=80.0, draft_n_max=0)


def _daemon_proc(data, srv, env) -> DaemonProc:
    """The daemon in its own process in front of `srv`, on short intervals (the rows come within seconds)."""
    return DaemonProc(data, "--simulate", "--upstream", srv.url, "--interval", "0.25", "--flush-interval", "0.5",
                      env=env)


def _post(url: str, body: dict, cut: bool, headers: dict | None = None) -> bytes | None:
    """POST `body` as JSON; `cut`: read 6 lines and leave (before the usage), else the whole answer's bytes."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    r = urllib.request.urlopen(req, timeout=60)
    if cut:
        for _ in range(6):
            r.readline()
        r.close()
        return None
    return r.read()


def _metrics_once_a_cut_is_estimated(d) -> str:
    """/metrics once it counts a cut request's prompt estimated (its intervals closed: held for the scrape and the
    prompt), or after 30 s (the caller's assertions then say what is missing)."""
    for _ in range(60):
        metrics = urllib.request.urlopen(d.info["metrics"] + "/metrics", timeout=10).read().decode()
        if 'powerprof_requests_prompt_estimated_total{reason="client_left"} 1.0' in metrics:
            break
        time.sleep(0.5)
    return metrics


def _h200_daemon(tmp_path, flavour: str, overrides: dict | None = None, **srv_kwargs):
    """A simulated continuous-batching server on an H200 (started) and a daemon in this process in front of it (1 s
    intervals, not started; `overrides` more config): (server, daemon)."""
    from powerprof.daemon.config import load_config
    from powerprof.daemon.service import Daemon
    from powerprof.rig import Rig

    nvml = SimNVML("h200-141g", state_path=None)
    srv = SimServer(nvml, flavour=flavour, n_slots=64, batching="continuous", **srv_kwargs).start()
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 1.0, "daemon.flush_interval_s": 5.0,
        "proxy.listen": "127.0.0.1:0", "proxy.upstream": srv.url, "metrics.listen": "",
        "daemon.restore_on_start": False, "tags.socket": str(tmp_path / "pp.sock"), **(overrides or {})})
    return srv, Daemon(cfg, Rig("h200-141g", nvml=nvml, host=False))


async def _leave_after(r, chunks: int = 8) -> None:
    """The client reads `chunks` pieces of streamed response `r`, then leaves (closes it)."""
    got = 0
    async for _ in r.content:
        got += 1
        if got > chunks:
            break
    r.close()


def _cut_prompt(srv, tmp_path):
    """(prompt estimate, true prompt tokens, energy note) of the request tagged "cut", left mid-stream."""
    truth = {**srv.request_truth(), **{c.get("client_id"): c for c in srv.truth_cancelled}}
    rows = {r["tag"]: r for r in read_dataset(tmp_path / "data", "requests").to_dict("records")
            if isinstance(r["tag"], str)}
    return rows["cut"]["prompt_tokens_estimate"], truth["cut"]["prompt_tokens"], rows["cut"]["energy_note"]


def _run_daemon(srv, daemon, scene, after_s: float, up=None, up_tries: int = 600) -> None:
    """Run `daemon`; once `up()` (by default: its proxy and ledger are up), or after `up_tries` looks 0.05 s apart,
    `await scene(proxy_url)`, wait `after_s`, stop it; the server stopped whatever happens."""
    import asyncio

    up = up or (lambda: "proxy" in daemon.urls and daemon.ledger is not None)

    async def main():
        task = asyncio.create_task(daemon.run())
        for _ in range(up_tries):
            if up():
                break
            await asyncio.sleep(0.05)
        await scene(daemon.urls["proxy"])
        await asyncio.sleep(after_s)
        daemon.stop_event.set()
        await task

    try:
        asyncio.run(main())
    finally:
        srv.stop()


def _errors_shown(rows: dict, truth: dict) -> dict:
    """Each row's energy error against the simulator's truth (for the tags the truth has), by tag; printed in percent
    (a failing test's output shows them all)."""
    err = {t: (r["gpu_energy_j"] - truth[t]["energy_j"]) / truth[t]["energy_j"] for t, r in rows.items() if t in truth}
    print({t: round(100 * e, 1) for t, e in sorted(err.items())})
    return err


def _rows_by_tag(tmp_path) -> dict:
    """The daemon's request rows that carry a tag, by tag."""
    return {r["tag"]: r for r in read_dataset(tmp_path / "data", "requests").to_dict("records")
            if isinstance(r["tag"], str)}


def _chat(words: int, path: str = "/v1/chat/completions") -> dict:
    if path == "/v1/responses":  # its usage comes in its last event (response.completed), and needs no asking
        return {"input": [{"role": "user", "content": [{"type": "input_text", "text": " ".join(["word"] * words)}]}],
                "max_output_tokens": 200, "ignore_eos": True, "stream": True}
    return {"messages": [{"role": "user", "content": " ".join(["word"] * words)}], "max_tokens": 200,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


# 2 workers: the prompt's size crosses from the proxy workers to the daemon. The Responses API: its body's prompt was
# not read, a cut stream's prefill costed 0 (silently; then said prompt-unread).
@pytest.mark.parametrize("workers, path", [("1", "/v1/chat/completions"), ("2", "/v1/chat/completions"),
                                           ("1", "/v1/responses")])
def test_a_stream_cut_before_its_usage_is_costed_an_estimated_prompt_and_says_so(tmp_path, workers, path):
    data = tmp_path / "data"
    with _seed_server("vllm") as srv:
        d = _daemon_proc(data, srv, {**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": workers})
        try:
            url = d.info["proxy"] + path
            for words, cut in ((300, False), (300, True)):
                got = _post(url, _chat(words, path), cut)  # cut: gone before the usage
                if not cut:
                    assert b'"prompt_tokens"' in got or path == "/v1/responses"
            metrics = _metrics_once_a_cut_is_estimated(d)
        finally:
            rc = d.stop()
    assert rc == 0, d.output()
    done, cut = read_dataset(data, "requests").sort_values("request_id").to_dict("records")
    true_prompt = count_prompt_tokens(" ".join(["word"] * 300))
    assert done["outcome"] == "ok" and done["prompt_tokens"] == true_prompt
    assert cut["outcome"] == "client_disconnected"
    # Before: no prompt length, no prefill work, and nothing on the row said its energy was short of it.
    assert cut["prompt_tokens_estimate"] == pytest.approx(true_prompt, rel=0.02)
    assert cut["energy_note"].startswith("approximate: the client left before the server said the prompt's length")
    fams = {f.name: f for f in text_string_to_metric_families(metrics)}
    got = {s.labels["reason"]: s.value for s in fams["powerprof_requests_prompt_estimated"].samples
           if s.name.endswith("_total")}
    assert got == {"client_left": 1, "no_usage": 0, "not_yet": 0, "before_first_token": 0}, got
    assert "costed at an estimate of" in d.output()


def test_a_llamacpp_prompt_of_ids_and_text_mixed_cut_before_its_usage_is_costed_its_ids_and_text_estimate(tmp_path):
    # llama-server takes a prompt mixing token ids and text (one prompt: the ids are its tokens, the text tokenized).
    # Before: the proxy read no size from it (`prompt-unread`), and a stream cut before its usage had its prefill
    # uncosted (its row's figure low, the requests beside it high). Now its ids plus its text's estimate, against the
    # simulator's truth.
    data = tmp_path / "data"
    ids = list(range(1000, 1100))
    with _seed_server("llamacpp") as srv:
        d = _daemon_proc(data, srv, sim_env(tmp_path))
        try:
            url = d.info["proxy"] + "/v1/completions"
            for tag, prompt, cut in (("text", " ".join(["word"] * 300), False),
                                     ("mixed", ids[:60] + [" ".join(["word"] * 200)] + ids[60:], True)):
                body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                _post(url, body, cut, {"X-Sim-Request-Id": tag})  # cut: gone before the usage
            _metrics_once_a_cut_is_estimated(d)
        finally:
            rc = d.stop()
        truth = {t["client_id"]: t for t in srv.truth + srv.truth_cancelled if t.get("client_id")}
    assert rc == 0, d.output()
    done, cut = read_dataset(data, "requests").sort_values("request_id").to_dict("records")
    assert cut["outcome"] == "client_disconnected"
    true_prompt = truth["mixed"]["prompt_tokens"]
    assert true_prompt == 100 + 200, truth["mixed"]  # no BOS: llama-server adds none where a prompt opens with an id
    assert cut["prompt_tokens_estimate"] == pytest.approx(true_prompt, rel=0.02), cut
    note = cut["energy_note"] or ""
    assert "the request's 100 prompt token ids and 999 prompt characters" in note, note
    assert PROMPT_UNREAD_FLAG not in note, note


def test_a_vllm_prompt_of_ids_cut_before_its_usage_is_costed_those_ids_as_the_server_counts_them(tmp_path):
    # vLLM runs a prompt of token ids as those tokens, adding no BOS; the proxy's estimate of a stream cut before its
    # usage is the ids' count. Before: the simulator ran them as text with a BOS (truth 101 for 100 ids), so the proxy
    # looked one token short against it where it is right against the real server.
    data = tmp_path / "data"
    ids = list(range(1000, 1100))
    with _seed_server("vllm") as srv:
        d = _daemon_proc(data, srv, sim_env(tmp_path))
        try:
            url = d.info["proxy"] + "/v1/completions"
            for tag, prompt, cut in (("text", " ".join(["word"] * 300), False), ("ids", ids, True)):
                body = {"model": "m", "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                _post(url, body, cut, {"X-Sim-Request-Id": tag})
            _metrics_once_a_cut_is_estimated(d)
        finally:
            rc = d.stop()
        truth = {t["client_id"]: t for t in srv.truth + srv.truth_cancelled if t.get("client_id")}
    assert rc == 0, d.output()
    done, cut = read_dataset(data, "requests").sort_values("request_id").to_dict("records")
    assert cut["outcome"] == "client_disconnected"
    assert truth["ids"]["prompt_tokens"] == len(ids), truth["ids"]
    assert cut["prompt_tokens_estimate"] == len(ids), cut


def test_llama_servers_progress_events_are_no_tokens_and_a_cut_native_stream_knows_its_prompt(tmp_path):
    # `return_progress: true` (session 46's walkthrough against the real llama-server): its prompt events (`tokens: [0]`)
    # were counted as tokens (52 for 50; the count then disbelieved and the row's J/token dropped, blaming "a proxy that
    # rewrites streams"), the first token's time was the prompt's start; and a native stream cut early said "the server
    # never said the prompt's length" where every chunk carries it (`tokens_evaluated`).
    data = tmp_path / "data"
    prompt = " ".join(["word"] * 300)
    body = {"prompt": prompt, "n_predict": 50, "ignore_eos": True, "stream": True}
    oai = {"prompt": prompt, "max_tokens": 50, "ignore_eos": True, "stream": True, "return_progress": True,
           "stream_options": {"include_usage": True}}
    with _seed_server("llamacpp") as srv:
        d = _daemon_proc(data, srv, sim_env(tmp_path))
        try:
            for path, b, cut in (("/completion", dict(body, return_progress=True), False), ("/completion", body, True),
                                 ("/v1/completions", oai, False)):
                got = _post(d.info["proxy"] + path, b, cut)
                if not cut:
                    assert b'"prompt_progress"' in got
            for _ in range(60):
                rows = read_dataset(data, "requests")
                if rows is not None and len(rows) == 3:
                    break
                time.sleep(0.5)
        finally:
            rc = d.stop()
    assert rc == 0, d.output()
    done, cut, oai_done = read_dataset(data, "requests").sort_values("request_id").to_dict("records")
    assert oai_done["generated_tokens"] == 50 and oai_done["attributed_tokens"] == pytest.approx(50), oai_done
    assert not isinstance(oai_done["error"], str) and oai_done["ttft_s"] > 0.5 * count_prompt_tokens(prompt) / srv.prefill_tok_s
    true_prompt = count_prompt_tokens(prompt)
    assert done["generated_tokens"] == 50 and done["attributed_tokens"] == pytest.approx(50), done
    assert not isinstance(done["error"], str) and done["gpu_j_per_token"] > 0, done
    assert done["ttft_s"] > 0.5 * true_prompt / srv.prefill_tok_s, done  # the first token's, not the prompt's start
    assert cut["outcome"] == "client_disconnected" and cut["prompt_tokens"] == true_prompt, cut
    # A simulated GPU beside a server it does not see (session 46: the daemon said nothing of it anywhere).
    assert "SIMULATED GPU (seed-16g) beside a real server" in d.output()
    assert "never said the prompt's length" not in (cut["energy_note"] or ""), cut["energy_note"]


def _cut_scene(tmp_path, flavour: str, normal_n: int, decode_at: tuple, whole_at: tuple) -> tuple[dict, dict, object]:
    """bench/cut_accuracy.py's scene, smaller: `normal_n` streams of 80 tokens 0.4 s apart, a stream cut after 40
    chunks after each in `decode_at`, a whole answer cut mid-prefill after each in `whole_at`, through the daemon (1 s
    intervals) in front of the simulated continuous-batching server (H200); its rows and the truth by tag, and the
    daemon."""
    import asyncio

    import aiohttp

    # llama-server's context is split among its slots (4096 each by default): a 12000-token prompt needs more.
    srv, daemon = _h200_daemon(tmp_path, flavour, n_ctx=64 * 16384 if flavour == "llamacpp" else None)
    # The scene's requests are bench/cut_accuracy.py's (the bench measures the docs' figures over it).
    normal, cut_decode, cut_whole = cut_accuracy._normal, cut_accuracy._cut_decode, cut_accuracy._cut_prefill

    async def scene(url):
        # The scraper has told the server's kind (SGLang's run-on delays with it): a fixed 4 s was short of it on a
        # loaded host (the CI beside other jobs: the first cut request said no run-on, twice).
        for _ in range(600):
            if daemon.ledger is not None and daemon.scraper.kind and (
                    flavour == "vllm" or daemon.ledger.runs_on_after_leave is not None):
                break
            await asyncio.sleep(0.05)
        assert daemon.scraper.kind == flavour, "the scraper never told the server's kind in 30 s"
        async with aiohttp.ClientSession() as s:
            jobs = []
            for k in range(normal_n):
                jobs.append(asyncio.create_task(normal(s, url, f"ok{k}")))
                if k in decode_at:
                    jobs.append(asyncio.create_task(cut_decode(s, url, f"cutd{k}")))
                if k in whole_at:
                    jobs.append(asyncio.create_task(cut_whole(s, url, f"cutw{k}")))
                await asyncio.sleep(0.4)
            await asyncio.gather(*jobs)

    # 6 s after the scene: past the last abort.
    _run_daemon(srv, daemon, scene, after_s=6, up=lambda: "proxy" in daemon.urls, up_tries=400)
    truth = {t["client_id"]: t for t in srv.truth if t.get("client_id")}
    truth.update({t["client_id"]: t for t in srv.truth_cancelled if t.get("client_id")})
    rows = _rows_by_tag(tmp_path)
    return rows, truth, daemon


def test_a_request_sglang_runs_on_after_its_client_left_is_charged_that_work_not_the_requests_beside_it(tmp_path):
    # SGLang aborts a stream's request 2 s after its client left and a whole answer's at its next 4 s wait
    # (docs/simulator.md, "A client that leaves"): until then the GPU decodes for nobody, and its token counters count
    # none of it. The daemon ended such a request where the proxy saw its client leave and gave that work to the
    # requests beside it: +54% to +251% (median +145%) on 24 streams beside 8 cut requests (H200), most saying only
    # the generic fixed-ratio note, the cut ones 29-61% low; a whole answer cut mid-prefill had no figure at all.
    rows, truth, daemon = _cut_scene(tmp_path, "sglang", 12, (2, 7), (4,))
    assert daemon.ledger.runs_on_after_leave is not None
    assert {t for t in rows if t.startswith("cut")} == {"cutd2", "cutd7", "cutw4"}, rows.keys()
    assert all(truth[t]["generated"] > 80 for t in ("cutd2", "cutd7", "cutw4"))  # it ran on for nobody
    err = {t: (r["gpu_energy_j"] - truth[t]["energy_j"]) / truth[t]["energy_j"] for t, r in rows.items()}
    for t in ("cutd2", "cutd7", "cutw4"):
        note = rows[t]["energy_note"] or ""
        # (Or "ran on … until its max_tokens were decoded": the whole answer's 300 at the estimated pace, before 4 s.)
        assert "the server ran on" in note and "SGLang aborts" in note, (t, note)
        # Its run-on's pace is an estimate: its batch's over that run (`Ledger._batch_pace`; its own read +38% to +76%
        # in cut_accuracy, docs/daemon.md, but within 0.5 in this smaller scene too).
        assert abs(err[t]) < 0.5, (t, err[t], note)
    ok = [t for t in rows if t.startswith("ok")]
    # Beside the whole answer its prefill is an estimate: those rows may be off, and say so (GONE_PREFILL_FLAG).
    unflagged = [t for t in ok if "gone-prefill-beside" not in (rows[t]["energy_note"] or "")]
    assert unflagged, [rows[t]["energy_note"] for t in ok]
    assert all(abs(err[t]) < 0.35 for t in unflagged), {t: round(err[t], 2) for t in unflagged}
    assert float(np.median([abs(err[t]) for t in ok])) < 0.3, {t: round(err[t], 2) for t in ok}


async def _leave_after_events(r, events: int) -> None:
    """Its client leaves the stream `r` after `events` data events (`_leave_after` counts lines)."""
    n = 0
    async for line in r.content:
        n += line.startswith(b"data:")
        if n == events:
            break
    r.close()


async def _until_run_ons_known(daemon) -> None:
    """Until the daemon knows its server's kind and run-on rule (its first scrapes), at most 30 s."""
    import asyncio

    for _ in range(600):
        if daemon.scraper.kind and daemon.ledger.runs_on_after_leave is not None:
            return
        await asyncio.sleep(0.05)


async def _until_idle_measured(daemon) -> None:
    """Until the daemon has measured the GPUs' idle power (a run of idle intervals workmodel.IDLE_MIN_S long closed), or
    30 s: requests before it are split with none, their rows uncertain-uncounted (rowtext._idle_unmeasured)."""
    import asyncio

    for _ in range(600):
        led = daemon.ledger
        if led is not None and led.edges and led.learner.costs(led.edges[-1].setting).idle_w is not None:
            return
        await asyncio.sleep(0.05)


async def _batch_span_end_ns(daemon) -> int:
    """The end (monotonic ns) of the span over which the daemon flags the rows beside a batch answered 400 under
    scrape.server = none (`Ledger._batch_spans`), once its ledger has taken the batch (up to 5 s)."""
    import asyncio

    for _ in range(100):
        if daemon.ledger._batch_spans:
            return max(a1 for _, a1 in daemon.ledger._batch_spans)
        await asyncio.sleep(0.05)
    raise AssertionError("the ledger took no span for the batch answered 400")


async def _tagged_stream(s, url, tag, body):
    """A streamed /v1/completions through `url`, `tag` both its simulator truth id and its row's tag."""
    return await s.post(url + "/v1/completions", json={"model": "m", "stream": True, **body},
                        headers={"X-Sim-Request-Id": tag, "X-Powerprof-Tag": tag})


async def _ok_100(s, url, k):
    """A tagged stream `ok{k}` of 100 tokens (ignore_eos, usage asked) over a 50-word prompt, read to its end."""
    async with await _tagged_stream(s, url, f"ok{k}", {"prompt": f"w{k} " * 50, "max_tokens": 100, "ignore_eos": True,
                                                       "stream_options": {"include_usage": True}}) as r:
        await r.read()


async def _stream_read_whole(s, url, k):
    """`ok{k}`: 80 tokens streamed with usage, its client there to the end (an honest neighbour)."""
    async with await _tagged_stream(s, url, f"ok{k}", {"prompt": f"w{k} " * 300, "max_tokens": 80,
                                                       "stream_options": {"include_usage": True}}) as r:
        await r.read()


async def _bypass_completion(s, server_url, k):
    """`byp{k}`: 40 tokens straight to the server, not through the proxy (bypass traffic)."""
    async with s.post(server_url + "/v1/completions", json={"model": "m", "prompt": f"b{k} " * 100,
                                                             "max_tokens": 40, "ignore_eos": True},
                      headers={"X-Sim-Request-Id": f"byp{k}"}) as r:
        await r.read()


def test_an_sglang_run_on_whose_answer_may_end_by_itself_is_uncertain_one_sent_with_ignore_eos_is_not(tmp_path):
    # SGLang runs a cut stream on to its abort 2 s later unless its answer ends by itself first (the simulator's end of
    # text, 16-63 tokens in, as a model's), unseen. Placed to the abort either way, the first was costed +100% to +300%
    # on the simulated SGLang, unflagged. Its body says which it is: without ignore_eos its row is uncertain-uncounted
    # (analyze leaves it out of J/token); with it (a long task, run on to the abort) sure, and close to the truth.
    import asyncio

    import aiohttp

    from powerprof.analysis.fleet import fleet_summary
    from powerprof.storage.schema import UNSURE_FLAG

    srv, daemon = _h200_daemon(tmp_path, "sglang", decode_tok_s=40.0)

    post, normal = _tagged_stream, _stream_read_whole

    async def cut(s, url, tag, **body):
        r = await post(s, url, tag, {"prompt": f"{tag} " * 300, "max_tokens": 2000, **body})
        await _leave_after_events(r, 5)

    async def scene(url):
        await _until_run_ons_known(daemon)
        await _until_idle_measured(daemon)  # else "long" may be uncertain for that alone (4% of it, one run)
        async with aiohttp.ClientSession() as s:
            jobs = [asyncio.create_task(normal(s, url, k)) for k in range(3)]
            jobs += [asyncio.create_task(cut(s, url, "eos")), asyncio.create_task(cut(s, url, "long", ignore_eos=True))]
            await asyncio.sleep(0.4)
            jobs += [asyncio.create_task(normal(s, url, k)) for k in range(3, 6)]
            await asyncio.gather(*jobs)

    _run_daemon(srv, daemon, scene, after_s=5, up=lambda: "proxy" in daemon.urls, up_tries=400)
    truth = {t["client_id"]: t for t in [*srv.truth, *srv.truth_cancelled] if t.get("client_id")}
    rows = _rows_by_tag(tmp_path)
    eos, long = rows["eos"], rows["long"]
    note = eos["energy_note"] or ""
    assert UNSURE_FLAG in note and "may have ended by itself" in note, note
    assert truth["eos"]["generated"] < eos["attributed_tokens"], (truth["eos"], eos)  # ended first: placed high
    assert UNSURE_FLAG not in (long["energy_note"] or ""), long["energy_note"]
    assert long["attributed_tokens"] == pytest.approx(truth["long"]["generated"], rel=0.2), (truth["long"], long)
    [h] = fleet_summary([str(tmp_path / "data")]).to_pylist()
    # Out of J/token, counted once: with its intervals' reason (their bypass count may hold its own tokens, counted by
    # SGLang at its end: run_on_may_end), as a request beside bypass traffic unmeasured (before: uncertain_requests 1).
    assert "run_on_may_end" in note and h["uncertain_requests"] == 0 and h["bypass_uncertain_requests"] >= 1, h


def test_bypass_traffic_beside_sglang_run_ons_it_aborted_is_read(tmp_path):
    # A cut stream whose answer may end by itself (here ignore_eos with a stop the simulator never meets: run on to
    # SGLang's abort, counted nowhere) is flagged uncertain-uncounted, and its placed run-on is not listed for the scrape
    # windows: listed (reverted 16f65a29, the review's F1), it lowered the gap as SGLang's count never did, and bypass
    # traffic beside it was hidden in rows saying `complete` (the review's scene: 274 of 480 bypass tokens read, the
    # requests beside them +15% to +20%, none flagged). Unlisted, one that ended by itself reads as bypass tokens
    # (docs/daemon.md: a known gap, high, never hidden).
    import asyncio

    import aiohttp

    from powerprof.storage.schema import UNSURE_FLAG

    srv, daemon = _h200_daemon(tmp_path, "sglang", decode_tok_s=40.0)

    post, normal = _tagged_stream, _stream_read_whole

    async def bypass(s, k):
        await _bypass_completion(s, srv.url, k)

    async def cut(s, url, tag):
        r = await post(s, url, tag, {"prompt": f"{tag} " * 300, "max_tokens": 2000, "ignore_eos": True,
                                     "stop": ["NEVER-MET"]})
        await _leave_after_events(r, 5)

    async def scene(url):
        await _until_run_ons_known(daemon)
        async with aiohttp.ClientSession() as s:
            jobs, nb = [], 0
            for k in range(12):
                jobs.append(asyncio.create_task(normal(s, url, k)))
                if k % 4 == 1:
                    jobs.append(asyncio.create_task(cut(s, url, f"cut{k}")))
                if k % 4 == 3:  # 0.8 s after the cut left: inside its run-on and CREDIT_S after it
                    jobs += [asyncio.create_task(bypass(s, nb + j)) for j in range(3)]
                    nb += 3
                await asyncio.sleep(0.4)
            await asyncio.gather(*jobs)
            # Past the last run-on's abort (its cut at 3.6 s, SGLang's 4 s wait) and the second after it: honest streams
            # in windows no run-on overlaps, so the check of the unflagged rows below has rows to check.
            await asyncio.sleep(4.0)
            await asyncio.gather(*[normal(s, url, k) for k in range(12, 15)])

    _run_daemon(srv, daemon, scene, after_s=6, up=lambda: "proxy" in daemon.urls, up_tries=400)
    truth = {t["client_id"]: t for t in [*srv.truth, *srv.truth_cancelled] if t.get("client_id")}
    rows = _rows_by_tag(tmp_path)
    ivs = read_dataset(tmp_path / "data", "intervals").to_dict("records")
    byp_tokens = sum(t["generated"] for c, t in truth.items() if c.startswith("byp"))
    byp_j = sum(t["energy_j"] for c, t in truth.items() if c.startswith("byp"))
    read_tokens = sum(x.get("server_tokens") or 0 for x in ivs)
    read_j = sum(x.get("unproxied_energy_j") or 0 for x in ivs)
    assert byp_tokens == 360
    for t in ("cut1", "cut5", "cut9"):
        assert UNSURE_FLAG in (rows[t]["energy_note"] or ""), rows[t]["energy_note"]
    notes = {t: r["energy_note"] if isinstance(r["energy_note"], str) else "" for t, r in rows.items()}
    flagged = [t for t in rows if t.startswith("ok") and "bypass-uncounted" in notes[t]]
    ok_err = _errors_shown({t: r for t, r in rows.items() if t.startswith("ok")}, truth)
    print("bypass", byp_tokens, round(byp_j, 1), "J; read", round(read_tokens, 1), round(read_j, 1), "J; flagged",
          len(flagged), "; ok mean", round(100 * float(np.mean(list(ok_err.values()))), 1))
    # Read whole (as the shown tokens of a cut stream, never counted by SGLang, may hide: 3 x 5), whether or not the
    # rows beside are flagged: the flag says their count may be high, never that real bypass traffic may be hidden
    # (before 9d8382c8's flag, `or len(flagged) >= 6` let a hidden bypass pass once every row was flagged).
    assert read_tokens >= 0.9 * byp_tokens, (read_tokens, byp_tokens, flagged)
    assert read_j >= 0.85 * byp_j, (read_j, byp_j, flagged)
    # The rows live in those run-ons' windows are flagged (run_on_may_end: their count may hold a run-on's tokens,
    # here all of them, a cut every 1.6 s), with that reason; the rows left unflagged are right. At least those sent
    # after the run-ons: before, `not err or` passed with none (every row of the run-ons' span flagged, none after).
    assert all("run_on_may_end" in notes[t] for t in flagged), {t: notes[t] for t in flagged}
    err = {t: e for t, e in ok_err.items() if t not in flagged}
    assert {"ok12", "ok13", "ok14"} <= set(err), (sorted(err), flagged)
    assert abs(float(np.mean(list(err.values())))) < 0.08, err


@pytest.mark.parametrize("with_batch", [True, False])
def test_an_sglang_batch_answered_400_puts_the_prompts_it_runs_for_nobody_in_unproxied_and_flags_the_rows_beside(
        tmp_path, with_batch):
    # SGLang answers a whole /generate batch 400 for one prompt its scheduler aborts (in the context's last 6 tokens)
    # and runs the others to their cap for nobody (tokenizer_manager.py @ 001067ff _collect_batch_responses). The
    # daemon charges that work to no row: the server's counter reads it as bypass tokens, in unproxied, beside honest
    # streams. Before, the 400's row said "no GPU work of it was seen", untrue; and the streams beside it read +19% to
    # +24%, unflagged: its counter counts the batch at its end, spread back only over the intervals still open then.
    # Now the windows over its run say batch_run_on and those streams are flagged; without the batch, none is
    # (docs/daemon.md, known limits).
    import asyncio

    import aiohttp

    srv, daemon = _h200_daemon(tmp_path, "sglang", decode_tok_s=100.0, n_ctx=256)
    band = " ".join(["w"] * 253)  # 254 tokens with the BOS, of a 256-token context: the other runs to its end

    async def batch(s, url):
        async with s.post(url + "/generate", json={"text": ["the power of the clock", band], "sampling_params": {
                "max_new_tokens": None, "ignore_eos": True}},
                headers={"X-Sim-Request-Id": "batch", "X-Powerprof-Tag": "batch"}) as r:
            assert r.status == 400, await r.text()

    async def scene(url):
        async with aiohttp.ClientSession() as s:
            if with_batch:
                await batch(s, url)
            await asyncio.gather(*[_ok_100(s, url, k) for k in range(3)])

    _run_daemon(srv, daemon, scene, after_s=4, up=lambda: "proxy" in daemon.urls, up_tries=400)
    truth = {t["client_id"]: t for t in srv.truth if t.get("client_id")}
    rows = _rows_by_tag(tmp_path)
    ivs = read_dataset(tmp_path / "data", "intervals").to_dict("records")
    read_j = sum(x.get("unproxied_energy_j") or 0 for x in ivs)
    err = _errors_shown({t: r for t, r in rows.items() if t.startswith("ok")}, truth)
    notes = {t: r["energy_note"] or "" for t, r in rows.items() if t.startswith("ok")}
    marked = [x for x in ivs if "batch_run_on" in (x.get("server_count") or "")]
    if not with_batch:  # the plain run: +2% each, nothing flagged, no window marked
        assert not marked and not any(BYPASS_LOW_FLAG in n for n in notes.values()), notes
        assert abs(float(np.mean(list(err.values())))) < 0.1, err
        return
    print("batch truth", truth["batch"]["generated"], round(truth["batch"]["energy_j"], 1), "J; unproxied",
          round(read_j, 1), "J")
    assert truth["batch"]["generated"] >= 240 and truth["batch"]["energy_j"] > 0, truth["batch"]
    assert rows["batch"]["status"] == 400 and not rows["batch"]["gpu_energy_j"] > 0, rows["batch"]
    assert "SGLang runs a batch's other prompts" in rows["batch"]["energy_note"], rows["batch"]["energy_note"]
    assert "batch_run_on" in rows["batch"]["energy_note"], rows["batch"]["energy_note"]
    assert read_j == pytest.approx(truth["batch"]["energy_j"], rel=0.2), read_j
    # Read high (+18% to +24%), so flagged, out of J/token: before, 'complete' and unflagged.
    assert all(BYPASS_LOW_FLAG in n and "batch_run_on" in n for n in notes.values()), notes
    assert marked and all("batch_run_on" in x["server_count"] for x in ivs if (x.get("proxy_tokens") or 0) > 0), marked


def test_an_sglang_batch_answered_400_with_no_server_scraped_flags_the_rows_beside_naming_scrape_server(tmp_path):
    # scrape.server = none: no scrape window to mark, so before the batch SGLang answers 400 while running its other
    # prompt for nobody (an explicit null max_new_tokens: to the context's end) left its work in the shares of the
    # streams beside it, unflagged. Now the rows live while that run may go on say uncertain-uncounted with the fix
    # (scrape.server); the span is bounded (the context, its abort's message's "maximum allowed length" + 6 tokens, at
    # half the streams' pace): the streams sent after it are not flagged.
    import asyncio

    import aiohttp

    from powerprof.daemon.ledger import BATCH_PREFILL_FLOOR_TOK_S
    from powerprof.daemon.rowtext import GONE_ABORT_SLACK_S
    from powerprof.storage.schema import UNSURE_FLAG

    srv, daemon = _h200_daemon(tmp_path, "sglang", overrides={"scrape.server": "none"}, decode_tok_s=100.0, n_ctx=256)
    band = " ".join(["w"] * 253)  # 254 tokens with the BOS, of a 256-token context: the other runs to its end
    spans: list = []  # the ledger's batch span(s), as the streams beside the batch ended
    paces: list = []  # the streams' pace the daemon had learned as it took the batch (tokens/s)

    async def scene(url):
        await _until_idle_measured(daemon)  # else the first streams are uncertain for that alone (start-up idle flag)
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*[_ok_100(s, url, 10 + k) for k in range(3)])  # a pace learned first
            await asyncio.sleep(1.5)  # in intervals of their own, apart from the batch's
            async with s.post(url + "/generate", json={"text": ["the power of the clock", band], "sampling_params": {
                    "max_new_tokens": None, "ignore_eos": True}},
                    headers={"X-Sim-Request-Id": "batch", "X-Powerprof-Tag": "batch"}) as r:
                assert r.status == 400, await r.text()
            span_end_ns = await _batch_span_end_ns(daemon)
            paces.append(float(np.median(daemon.ledger._paces)))  # the pace the bound was taken at, before ok0-2's
            await asyncio.gather(*[_ok_100(s, url, k) for k in range(3)])
            spans.extend(daemon.ledger._batch_spans)  # before the split lets it go
            # Past the bound: the 256-token context at the streams' pace shared by its 2 sequences (7.1 s from its
            # arrival quiet; before batch7's context bound, its prompts' 527 characters a token each, 2 BOS, + 6: 535
            # tokens, 12.4 s). The pace is the one the daemon learned, lower on a loaded host (the bound errs long
            # there, rightly): a fixed 14 s wait sent ok20 inside it, flagged. So they go once the ledger's newest sample
            # edge is past the span's end (an interval reaching past it begun), and at most 40 s on; the span's length
            # is held to its bound below.
            deadline = time.monotonic() + 40
            while daemon.ledger.edges[-1].t_ns < span_end_ns:
                assert time.monotonic() < deadline, (span_end_ns / 1e9, time.monotonic())  # a span left unbounded
                await asyncio.sleep(0.1)
            await asyncio.gather(*[_ok_100(s, url, 20 + k) for k in range(3)])

    _run_daemon(srv, daemon, scene, after_s=4, up=lambda: "proxy" in daemon.urls, up_tries=400)
    truth = {t["client_id"]: t for t in srv.truth if t.get("client_id")}
    rows = _rows_by_tag(tmp_path)
    assert daemon.scraper is None and truth["batch"]["generated"] >= 240, truth["batch"]  # it ran for nobody
    # The batch's true run ends within its span: the flags above would pass with any span of 1-14 s.
    ran = [t for t in [*srv.truth, *srv.truth_cancelled] if t.get("client_id") == "batch"]
    run_end = max(e[0] for t in ran for e in t["emissions"])
    print("batch run from its arrival s", (run_end - min(t["t_arrive_ns"] for t in ran)) / 1e9, "span",
          [((a - spans[0][0]) / 1e9, (b - spans[0][0]) / 1e9) for a, b in spans])
    (span_start, span_end), = spans
    assert run_end <= span_end, (run_end, spans)
    # And the span is bounded as said: the context's 256 tokens at half the pace the daemon had learned (its 2
    # sequences), 20% to spare, after its prompts' prefill (535 tokens at most, no rate learned: the floor's) and the
    # abort's slack. The wait above follows the span's own end: a bound grown from 8 s to 35 s passed it.
    bound_s = 256 / (paces[0] / 2) * 1.2 + 535 / BATCH_PREFILL_FLOOR_TOK_S + GONE_ABORT_SLACK_S
    assert not daemon.ledger._prefill_rates and (span_end - span_start) / 1e9 <= bound_s, (spans, paces, bound_s)
    err = _errors_shown({t: r for t, r in rows.items() if t.startswith("ok")}, truth)
    notes = {t: r["energy_note"] if isinstance(r["energy_note"], str) else "" for t, r in rows.items()}
    print({t: notes[t][:200] for t in sorted(notes)})
    said = {t for t, n in notes.items() if UNSURE_FLAG in n and "scrape.server" in n and "batch" in n}
    # Read high (+19% or more), so flagged, out of J/token: before, unflagged.
    assert {"ok0", "ok1", "ok2"} <= said, ({t: round(err[t], 2) for t in err}, said)
    assert not said & {"ok10", "ok11", "ok12", "ok20", "ok21", "ok22"}, said
    assert rows["batch"]["status"] == 400 and "scrape.server" in notes["batch"], notes["batch"]
    assert "cause (1 other sequence(s), up to 256 tokens each" in notes["batch"], notes["batch"]  # its client's
    assert UNSURE_FLAG not in notes["batch"], notes["batch"]  # no figure to leave out: not counted as flagged
    n_iv, n_tok = daemon.ledger.totals.jpt_left_out.get(UNSURE_FLAG, (0, 0.0))
    assert n_iv > 0 and n_tok > 0, daemon.ledger.totals.jpt_left_out


@pytest.mark.parametrize("server", ["sglang", "none"])
def test_a_streamed_sglang_completions_batch_with_a_band_prompt_flags_the_rows_beside_its_run(tmp_path, server):
    # Streamed, SGLang answers a /v1/completions batch holding a prompt in the context's last 6 tokens with a 200
    # whose one event is that abort's error, then [DONE], and aborts the other prompts 2 s after (its response's
    # background task: tokenizer_manager.py create_abort_task), uncounted: their prefill and decode go to the streams
    # beside it. Before: neither modelled nor marked. Now its windows say batch_run_on (scraped) or the rows live
    # there say uncertain-uncounted naming scrape.server (none), as for a whole batch.
    import asyncio

    import aiohttp

    from powerprof.storage.schema import UNSURE_FLAG

    srv, daemon = _h200_daemon(tmp_path, "sglang", overrides={"scrape.server": server}, decode_tok_s=100.0,
                               n_ctx=256)
    band = " ".join(["w"] * 249)  # 250 tokens with the BOS, of a 256-token context: + 6 fits, in the band
    others = [" ".join([f"p{k}"] * 200) for k in range(8)]

    async def scene(url):
        await _until_idle_measured(daemon)  # else the first streams are uncertain for that alone (start-up idle flag)
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*[_ok_100(s, url, 10 + k) for k in range(3)])  # a pace learned first
            await asyncio.sleep(1.5)
            async with await _tagged_stream(s, url, "batch", {"prompt": [*others, band], "max_tokens": 6,
                                                              "ignore_eos": True}) as r:
                assert r.status == 200 and b"maximum allowed length" in await r.read()
            await asyncio.gather(*[_ok_100(s, url, k) for k in range(3)])
            await asyncio.sleep(4.0)  # past the abort 2 s after its end, and a second
            await asyncio.gather(*[_ok_100(s, url, 20 + k) for k in range(3)])

    _run_daemon(srv, daemon, scene, after_s=4, up=lambda: "proxy" in daemon.urls, up_tries=400)
    truth = {t["client_id"]: t for t in [*srv.truth, *srv.truth_cancelled] if t.get("client_id")}
    rows = _rows_by_tag(tmp_path)
    err = _errors_shown({t: r for t, r in rows.items() if t.startswith("ok")}, truth)
    notes = {t: r["energy_note"] if isinstance(r["energy_note"], str) else "" for t, r in rows.items()}
    batch_j = sum(t["energy_j"] for t in [*srv.truth, *srv.truth_cancelled] if t.get("client_id") == "batch")
    print("batch truth", round(batch_j, 1), "J;", {t: notes[t][:160] for t in sorted(notes)})
    assert batch_j > 0
    word = "batch_run_on" if server == "sglang" else "scrape.server"
    flag = BYPASS_LOW_FLAG if server == "sglang" else UNSURE_FLAG
    said = {t for t, n in notes.items() if t.startswith("ok") and flag in n and word in n}
    assert {"ok0", "ok1", "ok2"} <= said, ({t: round(err[t], 3) for t in err}, said)
    assert not said & {"ok20", "ok21", "ok22"}, said
    assert "cause (8 other sequence(s), up to 6 tokens each" in notes["batch"], notes["batch"]


@pytest.mark.parametrize("bypass", [False, True])
def test_an_sglang_run_on_its_max_tokens_end_is_listed_as_counted_not_read_as_bypass(tmp_path, bypass):
    # A cut stream whose answer cannot end by itself (ignore_eos) and whose max_tokens end its run-on well before the
    # abort: SGLang finishes it (a length finish) and counts it whole. Unlisted, its run-on read as bypass tokens
    # besides being placed on its row (the review's F3: 142 bypass tokens where none ran, the requests beside -11%);
    # listed as SGLang's length finish, its windows waiting for its placing. Beside bypass traffic, that is still read.
    import asyncio

    import aiohttp

    srv, daemon = _h200_daemon(tmp_path, "sglang", decode_tok_s=40.0)

    post, normal = _tagged_stream, _stream_read_whole

    async def by(s, k):
        await _bypass_completion(s, srv.url, k)

    async def cut(s, url, tag):
        r = await post(s, url, tag, {"prompt": f"{tag} " * 300, "max_tokens": 40, "ignore_eos": True})
        await _leave_after_events(r, 5)

    async def scene(url):
        await _until_run_ons_known(daemon)
        async with aiohttp.ClientSession() as s:
            jobs, nb = [], 0
            for k in range(12):
                jobs.append(asyncio.create_task(normal(s, url, k)))
                if k % 4 == 1:
                    jobs.append(asyncio.create_task(cut(s, url, f"cut{k}")))
                if bypass and k % 4 == 3:
                    jobs += [asyncio.create_task(by(s, nb + j)) for j in range(3)]
                    nb += 3
                await asyncio.sleep(0.4)
            await asyncio.gather(*jobs)

    _run_daemon(srv, daemon, scene, after_s=6, up=lambda: "proxy" in daemon.urls, up_tries=400)
    truth = {t["client_id"]: t for t in [*srv.truth, *srv.truth_cancelled] if t.get("client_id")}
    rows = _rows_by_tag(tmp_path)
    ivs = read_dataset(tmp_path / "data", "intervals").to_dict("records")
    byp_tokens = sum(t["generated"] for c, t in truth.items() if c.startswith("byp"))
    read_tokens = sum(x.get("server_tokens") or 0 for x in ivs)
    for t in ("cut1", "cut5", "cut9"):
        assert truth[t]["generated"] == 40 and rows[t]["attributed_tokens"] == pytest.approx(40), (truth[t], rows[t])
    # At most the few a read's timing moves (3 cut streams' 35 run-on tokens each read so before: ~105).
    assert abs(read_tokens - byp_tokens) <= 20, (read_tokens, byp_tokens)
    # No window says a run-on's count (batch_run_on, run_on_may_end) may be in it, nor a row is flagged for one. A
    # loaded host may run the proxy late behind the server (streams reaching it in bursts up to 1 s apart): the windows
    # whose count the bursts' pace contradicts say proxy_lag, and the rows over them bypass-uncounted, rightly (beside
    # two CPU hogs 2 of 15 runs, beside another test's loop too 7 of 10: 3-11 such windows of 27, 366-367 tokens read
    # of 360, every flagged row for proxy_lag alone, some row's stream seen in bursts).
    notes = {t: r["energy_note"] or "" for t, r in rows.items()}
    flagged = {t: n for t, n in notes.items() if "bypass-uncounted" in n}
    lagged = [x for x in ivs if "proxy_lag" in (x.get("server_count") or "")]
    marks = [x.get("server_count") for x in ivs]
    assert not any("batch_run_on" in (m or "") or "run_on_may_end" in (m or "") for m in marks), marks
    assert not flagged or (lagged and any("reached the proxy in" in n for n in notes.values())), flagged
    lag_alone = "(proxy_lag: their server_count)"
    assert all(n.count("bypass-uncounted:") == 1 and lag_alone in n for n in flagged.values()), flagged


def test_a_prompt_whose_size_the_body_does_not_say_is_said_not_costed_and_its_neighbours_say_so(tmp_path):
    # A chat whose content holds an image part (its tokens are not its characters), no usage asked: the proxy read its
    # body but took no size from it, so its prefill was costed at 0 with nothing on its row (vLLM flavour, H200, 10
    # streams of 300-word prompts beside 2 image chats of ~3050 prompt tokens, three runs: the image rows -39% to -50%
    # against the truth, the streams sent beside them +38% to +89%, silent). Not costed still (no estimate worth one:
    # an image's tokens are not its characters), but said, on its row and theirs.
    import asyncio

    import aiohttp

    srv, daemon = _h200_daemon(tmp_path, "vllm")
    image = [{"type": "text", "text": "describe this"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64," + " ".join(["px"] * 3000)}}]

    async def chat(s, url, tag, content, usage):
        body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 80,
                "ignore_eos": True, "stream": True}
        if usage:
            body["stream_options"] = {"include_usage": True}
        async with s.post(url + "/v1/chat/completions", json=body,
                          headers={"X-Sim-Request-Id": tag, "X-Powerprof-Tag": tag}) as r:
            await r.read()

    async def scene(url):
        async with aiohttp.ClientSession() as s:
            jobs = []
            for k in range(10):
                jobs.append(asyncio.create_task(chat(s, url, f"ok{k}", " ".join(["word"] * 300), True)))
                if k in (3, 6):
                    jobs.append(asyncio.create_task(chat(s, url, f"img{k}", image, False)))
                await asyncio.sleep(0.4)
            await asyncio.gather(*jobs)

    _run_daemon(srv, daemon, scene, after_s=3)
    truth = {t["client_id"]: t for t in srv.truth if t.get("client_id")}
    rows = _rows_by_tag(tmp_path)
    err = {t: (r["gpu_energy_j"] - truth[t]["energy_j"]) / truth[t]["energy_j"] for t, r in rows.items()}
    print({t: round(100 * e, 1) for t, e in sorted(err.items())})
    for t in ("img3", "img6"):
        note = rows[t]["energy_note"] or ""
        assert rows[t]["prompt_tokens"] != rows[t]["prompt_tokens"] or rows[t]["prompt_tokens"] is None  # never said
        assert f"{PROMPT_UNREAD_FLAG}: its request body was read but its prompt's size could not be" in note, (t, note)
        assert "image_url" in note and "include_usage" in note, (t, note)
    beside = [t for t in rows if t.startswith("ok") and PROMPT_UNREAD_FLAG in (rows[t]["energy_note"] or "")]
    assert {"ok3", "ok6"} <= set(beside), {t: rows[t]["energy_note"] for t in rows}
    print(sorted(beside))
    assert daemon.ledger.flagged_requests[PROMPT_UNREAD_FLAG] == 2 + len(beside)


def test_a_clients_text_naming_a_flag_does_not_leave_its_row_out_of_j_per_token(tmp_path):
    # The review's scene: a chat whose content part's type is the text "uncertain-uncounted", no usage asked, beside
    # six 300-word streams (vLLM flavour, H200). Its note quoted the part's type (prompt-unread's reason), so analyze's
    # LIKE left it out of J/token and counted it uncertain (uncertain_requests 1, 306 tokens of 331), a false reason.
    import asyncio

    import aiohttp

    from powerprof.analysis.fleet import fleet_summary
    from powerprof.storage.schema import BYPASS_LOW_FLAG, UNSURE_FLAG

    srv, daemon = _h200_daemon(tmp_path, "vllm", decode_tok_s=50.0)

    async def chat(s, url, tag, content, delay):
        await asyncio.sleep(delay)
        so = {} if tag == "crafted" else {"stream_options": {"include_usage": True}}
        async with s.post(url + "/v1/chat/completions",
                          json=dict(model="m", messages=[{"role": "user", "content": content}], max_tokens=150,
                                    stream=True, **so),
                          headers={"X-Sim-Request-Id": tag, "X-Powerprof-Tag": tag}) as r:
            await r.read()

    async def scene(url):
        await _until_idle_measured(daemon)  # else the first stream is uncertain for that alone (the start-up idle flag)
        async with aiohttp.ClientSession() as s:
            jobs = [chat(s, url, f"ok{k}", "word " * 300, 0.3 * k) for k in range(6)]
            jobs.append(chat(s, url, "crafted", [{"type": "text", "text": "word " * 300},
                                                 {"type": UNSURE_FLAG, "data": "x"}], 0.5))
            await asyncio.gather(*jobs)

    _run_daemon(srv, daemon, scene, after_s=6)
    rows = _rows_by_tag(tmp_path)
    note = rows["crafted"]["energy_note"] or ""
    assert PROMPT_UNREAD_FLAG in note and UNSURE_FLAG not in note, note
    [h] = fleet_summary([str(tmp_path / "data")]).to_pylist()
    print({k: v for k, v in h.items() if "request" in k or "token" in k or "interval" in k})
    assert h["requests"] == 7 and h["uncertain_requests"] == 0, h
    # In J/token with every row its host's count does not leave out (a late first scrape on a loaded machine can flag
    # them all bypass-uncounted, which is true of them all alike).
    kept = [r for r in rows.values() if BYPASS_LOW_FLAG not in (r["energy_note"] or "")]
    assert (h["attributed_tokens"] or 0.0) == pytest.approx(sum(r["attributed_tokens"] for r in kept)), h


def test_a_stateful_responses_turn_past_the_prompt_hold_is_costed_its_stored_conversation(tmp_path):
    # A Responses turn naming a previous_response_id the proxy saw answered: its usage (response.completed) comes only
    # at its end, past the prompt hold; its prefill is costed at that answer's counted conversation (its input_tokens
    # + output_tokens) plus its new input's estimate. Before: costed none and flagged prompt-unread though never cut
    # (the reviewer's 3000-word history, 1000 tokens at 25 tok/s: its energy -5% vs truth, its three neighbours
    # +9-10%). The hold is 3 s here (30 s in use) so the scene is short.
    import asyncio

    import aiohttp

    srv, daemon = _h200_daemon(tmp_path, "vllm", decode_tok_s=25.0)

    async def post(s, url, tag, body, n):
        return await s.post(url + "/v1/responses", json=dict(body, model="m", max_output_tokens=n, ignore_eos=True),
                            headers={"X-Sim-Request-Id": tag, "X-Powerprof-Tag": tag})

    async def scene(url):
        daemon.ledger.prompt_hold_ns = int(3e9)
        async with aiohttp.ClientSession() as s:
            r = await post(s, url, "first", {"input": " ".join(["word"] * 3000)}, 4)
            rid = (await r.json())["id"]
            jobs = [asyncio.create_task(post(s, url, f"ok{k}", {"input": " ".join(["word"] * 300), "stream": True},
                                             120)) for k in range(3)]
            await asyncio.sleep(0.3)
            jobs.append(asyncio.create_task(post(s, url, "long", {"input": "next", "previous_response_id": rid,
                                                                   "stream": True}, 150)))  # 6 s at 25 tok/s
            for r in await asyncio.gather(*jobs):
                assert r.status == 200
                await r.read()

    _run_daemon(srv, daemon, scene, after_s=3)
    truth = srv.request_truth()
    rows = _rows_by_tag(tmp_path)
    err = _errors_shown(rows, truth)
    assert rows["long"]["prompt_tokens"] == truth["long"]["prompt_tokens"] > 3000, (rows["long"], truth["long"])
    for t in ("long", "ok0", "ok1", "ok2"):
        note = rows[t]["energy_note"] or ""
        assert PROMPT_UNREAD_FLAG not in note, (t, note)
        # Measured: long -6% to -7%, the others +2% to +7% (before: long -17%, the others +5% to +17%, flagged).
        assert abs(err[t]) < 0.12, (t, err[t], note)


CHAIN_TOOLS = [{"type": "function", "name": "search", "description": " ".join(["find"] * 1000),
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]
CHAIN_INSTRUCTIONS = " ".join(["rule"] * 400)


@pytest.mark.parametrize("extra,think,turn_n", [
    ({"tools": CHAIN_TOOLS}, 0, 40), ({"instructions": CHAIN_INSTRUCTIONS}, 0, 40),
    ({"tools": CHAIN_TOOLS[:1], "tool_choice": "required"}, 0, 400), ({}, 350, 400)],
    ids=["tools", "instructions", "calls", "thinking"])
def test_a_cut_stateful_turn_is_estimated_at_what_the_server_prefills_again(tmp_path, extra, think, turn_n):
    # A chain of Responses turns each sending the same `extra`, then a turn naming the last, its stream cut before
    # its usage: its prompt is estimated from the named turn's counted conversation and its own body. vLLM renders each
    # request's own tools (construct_tool_dicts), never the stored turn's: the named turn's tools are not prefilled
    # again. Before: counted twice (the remembered input_tokens held them, the new body's size again), the reviewer's
    # chain +108% on this simulator (which did not render a Responses turn's tools: 1977 est., 951 true) and +52%
    # against a simulator patched to vLLM's rendering (3050 est., 2011 true). Nor are its instructions: vLLM drops
    # the stored turn's system messages (construct_input_messages, since vllm-project/vllm#37727). Before: remembered
    # with its input_tokens, +14% against vLLM so patched (3257 est., 2851 true). Nor its output's function calls
    # (`calls`: each turn a forced call of 400 tokens) nor its thinking (`thinking`: 350 of each turn's 400 tokens):
    # construct_input_messages adds only the stored output's messages. Before, each call was remembered as context:
    # +23% (2111 est., 1711 true; now 1711); the thinking left in, +47% (1100 est., 749 true; now 750).
    import asyncio

    import aiohttp

    from powerprof.daemon.config import load_config
    from powerprof.daemon.service import Daemon
    from powerprof.rig import Rig

    nvml = SimNVML("h200-141g", state_path=None)
    srv = SimServer(nvml, flavour="vllm", n_slots=64, batching="continuous", decode_tok_s=50.0 * turn_n / 40,
                    reasoning_tokens=think).start()
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 1.0, "daemon.flush_interval_s": 5.0,
        "proxy.listen": "127.0.0.1:0", "proxy.upstream": srv.url, "metrics.listen": "",
        "daemon.restore_on_start": False, "tags.socket": str(tmp_path / "pp.sock")})
    daemon = Daemon(cfg, Rig("h200-141g", nvml=nvml, host=False))

    async def post(s, url, tag, body, n):
        return await s.post(url + "/v1/responses", json=dict(body, model="m", max_output_tokens=n, ignore_eos=True),
                            headers={"X-Sim-Request-Id": tag, "X-Powerprof-Tag": tag})

    async def main():
        task = asyncio.create_task(daemon.run())
        for _ in range(600):
            if "proxy" in daemon.urls and daemon.ledger is not None:
                break
            await asyncio.sleep(0.05)
        url = daemon.urls["proxy"]
        async with aiohttp.ClientSession() as s:
            for k in range(3):  # the tokens a character learned from bodies the proxy sizes whole
                r = await post(s, url, f"warm{k}", {"input": " ".join(["word"] * (400 + 300 * k))}, 4)
                await r.read()
            prev = None
            for k in range(2):
                body = dict(extra, input=" ".join(["word"] * 300), **({"previous_response_id": prev} if prev else {}))
                r = await post(s, url, f"turn{k}", body, turn_n)
                prev = (await r.json())["id"]
            r = await post(s, url, "cut", dict(extra, input="next " * 50, previous_response_id=prev, stream=True),
                           200 * turn_n // 40)
            await _leave_after(r)
        await asyncio.sleep(6)
        daemon.stop_event.set()
        await task

    try:
        asyncio.run(main())
    finally:
        srv.stop()
    est, true, note = _cut_prompt(srv, tmp_path)
    print("estimate", est, "truth", true)
    assert abs(est - true) / true < 0.05, (est, true)


def test_a_stateful_responses_turn_is_costed_the_conversation_its_usage_says_and_flagged_only_where_none(tmp_path):
    # A Responses turn with `previous_response_id` (vLLM, store on): its body holds the new input only; the server
    # prefills the stored conversation before it and says the whole in usage.input_tokens (response.completed on a
    # stream). Where the answer carries it, its prefill is costed from it (the ledger's path for any server count);
    # only a turn whose answer carried none (its stream cut) stays prompt-unread. The simulator ignored the field
    # before (its truth the new input alone), so no figure here could be judged against a stateful turn's truth.
    # cut8 names a turn answered past the proxy (no length of it kept): its prefill stays unread.
    import asyncio

    import aiohttp

    srv, daemon = _h200_daemon(tmp_path, "vllm")

    async def post(s, url, tag, body):
        return await s.post(url + "/v1/responses", json=dict(body, model="m", max_output_tokens=80, ignore_eos=True),
                            headers={"X-Sim-Request-Id": tag, "X-Powerprof-Tag": tag})

    async def turn(s, url, tag, prev, cut=False):
        body = {"input": "and the next step", "previous_response_id": prev, "stream": cut}
        r = await post(s, url, tag, body)
        if cut:  # its client leaves mid-stream, before response.completed and its usage
            n = 0
            async for line in r.content:
                n += line.startswith(b"data:")
                if n == 20:
                    break
            r.close()
        else:
            assert r.status == 200, await r.text()
            await r.read()

    async def scene(url):
        async with aiohttp.ClientSession() as s:
            ids = []
            for k in range(3):  # the stored first turns: ~3000 words of history each; the last not through the proxy
                r = await post(s, url if k < 2 else srv.url, f"first{k}", {"input": " ".join(["word"] * 3000)})
                ids.append((await r.json())["id"])
            jobs = []
            for k in range(10):
                jobs.append(asyncio.create_task(post(s, url, f"ok{k}", {"input": " ".join(["word"] * 300),
                                                                         "stream": True})))
                if k in (3, 6):
                    jobs.append(asyncio.create_task(turn(s, url, f"turn{k}", ids[k // 3 - 1])))
                if k == 8:
                    jobs.append(asyncio.create_task(turn(s, url, "cut8", ids[2], cut=True)))
                await asyncio.sleep(0.4)
            for r in await asyncio.gather(*jobs):
                if r is not None:
                    await r.read()

    _run_daemon(srv, daemon, scene, after_s=3)
    truth = srv.request_truth()
    rows = _rows_by_tag(tmp_path)
    err = _errors_shown(rows, truth)
    own = f"{PROMPT_UNREAD_FLAG}: its request body was read but its prompt's size could not be"
    for t in ("turn3", "turn6"):
        assert truth[t]["prompt_tokens"] > 3000, truth[t]  # the stored conversation, prefilled again
        assert rows[t]["prompt_tokens"] == truth[t]["prompt_tokens"], (rows[t]["prompt_tokens"], truth[t])
        note = rows[t]["energy_note"] or ""
        assert own not in note, (t, note)  # (turn6 may run beside cut8's uncosted prefill, and say that)
        if PROMPT_UNREAD_FLAG not in note:
            assert abs(err[t]) < 0.25, (t, err[t], note)  # +11% measured (the work model's fixed ratio, no fit yet)
    assert PROMPT_UNREAD_FLAG not in (rows["turn3"]["energy_note"] or "")
    note = rows["cut8"]["energy_note"] or ""
    assert own in note, note
    assert "previous_response_id" in note and "fix: send the conversation in the body's `input`" in note, note
    ok = [t for t in rows if t.startswith("ok")]
    # The streams sent with the costed turns (not beside cut8) are not told of an unread prefill, nor given its energy.
    clean = [t for t in ok if PROMPT_UNREAD_FLAG not in (rows[t]["energy_note"] or "")]
    assert {"ok3", "ok4"} <= set(clean), {t: rows[t]["energy_note"] for t in ok}
    assert float(np.median([abs(err[t]) for t in clean])) < 0.25, {t: round(err[t], 2) for t in clean}


def test_a_whole_answer_cut_mid_prefill_on_vllm_is_costed_its_prompt_not_the_requests_beside_it(tmp_path):
    # vLLM aborts a request at once when its client leaves, so a whole answer cut while its prompt prefilled ran from its
    # arrival (or its queue exit) until then. Its row had no figure, and its prefill's energy went to the streams
    # beside it (cut_accuracy: 3 of 4 with no figure, the 24 beside them up to +183%, median |error| 44%).
    rows, truth, _ = _cut_scene(tmp_path, "vllm", 8, (), (2, 5))
    assert {t for t in rows if t.startswith("cut")} == {"cutw2", "cutw5"}, rows.keys()
    err = {t: (r["gpu_energy_j"] - truth[t]["energy_j"]) / truth[t]["energy_j"] for t, r in rows.items()}
    for t in ("cutw2", "cutw5"):
        note = rows[t]["energy_note"] or ""
        # (Cut mid-prefill, or on a loaded host, its client's 0.25 s late, just after: it decoded a few tokens unseen.)
        assert truth[t]["prefilled"] > 0 and truth[t]["generated"] < 80, truth[t]
        # Its prompt at its body's estimate, no more than its time in flight had room for: an estimate, and said so.
        assert "it ended before its first token" in note and "no share" not in note, (t, note)
        assert rows[t]["prompt_tokens_estimate"] > 0, rows[t]
        assert abs(err[t]) < 0.6, (t, err[t], note)
    ok = [t for t in rows if t.startswith("ok")]
    assert float(np.median([abs(err[t]) for t in ok])) < 0.3, {t: round(err[t], 2) for t in ok}
    assert max(err[t] for t in ok) < 0.8, {t: round(err[t], 2) for t in ok}


def test_a_whole_answer_llamacpp_runs_on_after_its_client_left_is_charged_that_work_not_the_requests_beside_it(
        tmp_path):
    # llama-server looks at a whole answer's connection only after a second in which it sent no result to any request
    # (docs/simulator.md, "A client that leaves"): beside streams, and scraped every 0.25 s, a whole answer cut 0.25 s
    # in prefills and decodes its 300 tokens for nobody. Costed as one aborted at once, its prompt alone bounded by its
    # time in flight: cut_accuracy read them -87% to -76%, the streams beside them up to +194%.
    rows, truth, daemon = _cut_scene(tmp_path, "llamacpp", 8, (), (2, 5))
    assert daemon.ledger.runs_on_after_leave is not None
    assert {t for t in rows if t.startswith("cut")} == {"cutw2", "cutw5"}, rows.keys()
    assert all(truth[t]["generated"] == 300 for t in ("cutw2", "cutw5"))  # it ran on to its end, for nobody
    err = {t: (r["gpu_energy_j"] - truth[t]["energy_j"]) / truth[t]["energy_j"] for t, r in rows.items()}
    for t in ("cutw2", "cutw5"):
        note = rows[t]["energy_note"] or ""
        assert "ran on after its client left" in note and "llama-server" in note, (t, note)
        assert abs(err[t]) < 0.5, (t, err[t], note)
    ok = [t for t in rows if t.startswith("ok")]
    assert float(np.median([abs(err[t]) for t in ok])) < 0.3, {t: round(err[t], 2) for t in ok}
    assert max(err[t] for t in ok) < 0.8, {t: round(err[t], 2) for t in ok}


@pytest.mark.parametrize("flavour", ["sglang", "vllm", "vllm-exclude"])
def test_a_cut_chat_whose_tool_choice_is_none_is_sized_as_its_server_renders_its_tools(tmp_path, flavour):
    # A chat's `tools` with tool_choice "none": SGLang's template renders none of them (as vLLM's with
    # --exclude-tools-when-tool-choice-none), vLLM by default all; the body cannot say which. The ledger learns it
    # from such a request the server counted (its count nearer the size with or without them) and sizes a cut one
    # so. Before: its tools always counted, and learned from as prompt characters: on SGLang a cut one estimated at
    # 949 for a true 301 (+215%; now 301), vLLM with the flag 1324 for 301 (now 301), vLLM 1331 for 1347 (now 1324).
    import asyncio

    import aiohttp

    from powerprof.daemon.config import load_config
    from powerprof.daemon.service import Daemon
    from powerprof.rig import Rig

    tools = [{"type": "function", "function": {"name": "search", "description": " ".join(["find"] * 1000),
                                               "parameters": {"type": "object"}}}]
    nvml = SimNVML("h200-141g", state_path=None)
    srv = SimServer(nvml, flavour=flavour.split("-")[0], n_slots=64, batching="continuous", decode_tok_s=50.0,
                    exclude_tools_when_tool_choice_none=flavour.endswith("-exclude")).start()
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 1.0, "daemon.flush_interval_s": 5.0,
        "proxy.listen": "127.0.0.1:0", "proxy.upstream": srv.url, "metrics.listen": "",
        "daemon.restore_on_start": False, "tags.socket": str(tmp_path / "pp.sock")})
    daemon = Daemon(cfg, Rig("h200-141g", nvml=nvml, host=False))

    def chat(words, **kw):
        return dict(kw, model="m", messages=[{"role": "user", "content": " ".join(["word"] * words)}])

    async def main():
        task = asyncio.create_task(daemon.run())
        for _ in range(600):
            if "proxy" in daemon.urls and daemon.ledger is not None:
                break
            await asyncio.sleep(0.05)
        url = daemon.urls["proxy"] + "/v1/chat/completions"
        async with aiohttp.ClientSession() as s:
            # Three prompts with no such tools first: the ratio a tools-"none" prompt is judged against (its spread).
            for k, kw in enumerate([{}, {}, {}, {"tools": tools, "tool_choice": "none"}, {}]):
                r = await s.post(url, json=chat(200 + 300 * k, max_tokens=4, **kw),
                                 headers={"X-Sim-Request-Id": f"warm{k}", "X-Powerprof-Tag": f"warm{k}"})
                await r.read()
            r = await s.post(url, json=chat(300, max_tokens=400, stream=True, tools=tools, tool_choice="none"),
                             headers={"X-Sim-Request-Id": "cut", "X-Powerprof-Tag": "cut"})
            await _leave_after(r)
        await asyncio.sleep(6)
        daemon.stop_event.set()
        await task

    try:
        asyncio.run(main())
    finally:
        srv.stop()
    est, true, note = _cut_prompt(srv, tmp_path)
    print(flavour, "estimate", est, "truth", true, note)
    assert abs(est - true) / true < 0.05, (est, true)


async def _server_known(daemon) -> None:
    """Wait (30 s at most) till the daemon's ledger knows how its server runs a request on after its client left."""
    import asyncio

    for _ in range(600):
        if daemon.ledger is not None and daemon.ledger.runs_on_after_leave is not None:
            return
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("flavour,down_s,stale_s,loading_s", [("sglang", 0.5, None, 0.0), ("llamacpp", 0.5, None, 0.0),
                                                              ("llamacpp", 10.5, None, 0.0), ("sglang", 0.5, 5.0, 0.0),
                                                              ("llamacpp", 0.05, None, 10.5),
                                                              ("llamacpp", 0.05, 5.0, 10.5)],
                         ids=["sglang", "llamacpp", "llamacpp_reload", "sglang_read_as_stale", "llamacpp_reload_503",
                              "llamacpp_reload_503_read_as_stale"])
def test_whole_answers_in_flight_when_the_server_crashes_are_costed_to_the_crash(tmp_path, monkeypatch, flavour, down_s,
                                                                                 stale_s, loading_s):
    # Two whole answers (max_tokens 2000, not streamed) decode for about 1 s when the simulated server's process dies
    # (srv.restart: its sockets reset), back `down_s` later. A whole answer's head comes only when it is done, so the
    # proxy saw the connection close before any answer, as it sees a refused connect: both were upstream_unreachable,
    # no tokens and no energy (truth about 130 tokens and 148 J each, H200), that energy idle, nothing said on their
    # rows. The server had them whole: they are upstream_error, costed to the crash, and their rows say so.
    # Down 10.5 s (a model reload, the usual case), the restart was known only at the new process's first scrape, after
    # SCRAPE_HOLD_S had written their rows: 0 J each against about 146 J of truth. The scrapes refused meanwhile
    # (nothing listening) open the crash's window at once (`Ledger.note_down`).
    # The answer sent on the warm-up's kept-alive connection, closed 1.0 s in, reads as a close that crossed it when
    # that is inside forward.STALE_CLOSE_MAX_S (1.0 s: about 1 run in 3; `stale_s` makes it every run): sent again, the
    # resend refused, it was upstream_unreachable, 0 J, and its work went to the other's row (305-310 J for 145).
    # llama-server binds its port at once as it restarts and answers 503 "Loading model" while it loads (`loading_s`):
    # its scrapes found it down by a 503, nothing refused, and no death was shown: 0 J each against about 146 J of
    # truth. Sent before the old process's last good scrape, they were in flight at a live server: costed, marked
    # uncertain-uncounted (a queuing router refusing a request it held reads the same). The crash comes 1.5 s in there,
    # past STALE_CLOSE_MAX_S; read as a crossing close (`stale_s`), the resend met the loading 503, which was relayed
    # as the request's answer (the client got 503, the row an error answer at 0 J): now the server down
    # (proxy.RESEND_LOADING), costed as the other.
    import asyncio

    from powerprof.daemon import forward

    if stale_s is not None:
        monkeypatch.setattr(forward, "STALE_CLOSE_MAX_S", stale_s)
    if stale_s is not None and loading_s:
        # The resend's connect 0.2 s late (a loaded proxy host), after the new process bound its port: it meets the
        # loading page. On time it is refused (down 0.05 s).
        acquire = forward.UpstreamPool.acquire

        async def late(self, fresh=False):
            if fresh:
                await asyncio.sleep(0.2)
            return await acquire(self, fresh)

        monkeypatch.setattr(forward.UpstreamPool, "acquire", late)

    import aiohttp

    srv, daemon = _h200_daemon(tmp_path, flavour)

    async def whole(s, url, tag):
        try:
            async with await cut_accuracy._post(s, url, tag, {"prompt": cut_accuracy._words(300), "max_tokens": 2000,
                                                              "stream": False}) as r:
                await asyncio.wait_for(r.read(), 10.0)
                return r.status
        except aiohttp.ClientError as e:
            return type(e).__name__

    async def scene(url):
        await _server_known(daemon)
        async with aiohttp.ClientSession() as s:
            await cut_accuracy._normal(s, url, "warm")  # a stream's pace: the decode's estimate
            if stale_s is not None and flavour == "llamacpp":
                # llama-server closes a connection after a stream: a whole answer leaves one kept alive for w0 to take.
                async with await cut_accuracy._post(s, url, "kept", {"prompt": cut_accuracy._words(20), "max_tokens": 4,
                                                                     "stream": False}) as r:
                    await r.read()
            jobs = [asyncio.create_task(whole(s, url, f"w{k}")) for k in range(2)]
            await asyncio.sleep(1.5 if loading_s else 1.0)
            await asyncio.wrap_future(srv.restart(down_s, loading_s=loading_s))
            # The resend that met the loading page relays it (the server's own 503), the other gets the proxy's 502.
            assert sorted(await asyncio.gather(*jobs)) == ([502, 503] if stale_s is not None and loading_s else [502, 502])

    _run_daemon(srv, daemon, scene, after_s=4)
    truth = {t["client_id"]: t for t in srv.truth + srv.truth_cancelled if t.get("client_id")}
    rows = _rows_by_tag(tmp_path)
    for t in ("w0", "w1"):
        row, want = rows[t], truth[t]
        note = row["energy_note"] or ""
        print(t, row["outcome"], row["attributed_tokens"], row["gpu_energy_j"], want.get("generated"), want["energy_j"],
              row.get("error"))
        assert row["outcome"] == "upstream_error" and row["status"] == (503 if "loading page" in row["error"] else 502), row
        assert row["gpu_energy_j"] == pytest.approx(want["energy_j"], rel=0.25), (row["gpu_energy_j"], want, note)
        assert "closed its connection with no answer" in note, note
    # The decode placed to the close is listed for the scrape windows where the server counts tokens as they come
    # (llama.cpp's /slots): unlisted, it read as bypass tokens, about 158 J in `unproxied` (the rows -31% to -57%).
    # Not checked on SGLang: its new process's first window counts 2 tokens no request shows, and the down intervals'
    # idle power, about 100 J, reads as `unproxied` (not from these rows; a gap not yet found). After a 503 reload the
    # crash is known only at the first 503 scrape, after the close: a window resolved between them kept 0-69 J of the
    # decode as bypass tokens, till the windows waited for that scrape.
    iv = read_dataset(tmp_path / "data", "intervals")
    unproxied_j = float(iv["unproxied_energy_j"].fillna(0).sum())
    print("unproxied", unproxied_j)
    if flavour == "llamacpp":
        assert unproxied_j < 0.1 * (truth["w0"]["energy_j"] + truth["w1"]["energy_j"]), unproxied_j


def test_a_router_503_blip_and_a_held_request_it_closes_unanswered_cost_no_crash(tmp_path):
    # The simulated llama.cpp (H200) stays up throughout behind a small router that the daemon proxies to and scrapes
    # (proxy.upstream = the router). The router holds one whole answer ("queued", never sent to the server) and closes
    # its connection with no answer, while it answers /metrics and /slots 503 with an empty body for 0.7 s (a rate
    # limit, its own backend check); no restart. The 503 read as a death's window: "queued" was costed 119 J / 118
    # tokens (truth 0, its row saying its process died) and the live whole answer beside it 1099 J for 1177 J of truth.
    import asyncio
    import threading

    import aiohttp

    from powerprof.daemon.config import load_config
    from powerprof.daemon.service import Daemon
    from powerprof.rig import Rig

    nvml = SimNVML("h200-141g", state_path=None)
    srv = SimServer(nvml, flavour="llamacpp", n_slots=64, batching="continuous").start()
    sim_host, sim_port = srv.url.split("//")[1].split(":")
    state: dict = {"blip": False, "close_queued": None}
    rloop, ready, rport = asyncio.new_event_loop(), threading.Event(), [0]

    async def handle(reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1]
            hdr = {ln.split(":", 1)[0].strip().lower(): ln.split(":", 1)[1].strip() for ln in lines[1:] if ":" in ln}
            body = await reader.readexactly(int(hdr.get("content-length", "0")))
            if state["blip"] and path.split("?")[0] in ("/metrics", "/slots"):
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                writer.close()
                return
            if hdr.get("x-sim-request-id") == "queued":
                ev = asyncio.Event()
                state["close_queued"] = ev
                await ev.wait()
                writer.transport.abort()  # closed with no answer: never sent on
                return
            out = [ln for ln in lines[1:] if ln and not ln.lower().startswith("connection:")]
            up_r, up_w = await asyncio.open_connection(sim_host, int(sim_port))
            up_w.write(("\r\n".join([lines[0]] + out + ["Connection: close", "", ""])).encode("latin-1") + body)
            await up_w.drain()
            while b := await up_r.read(65536):
                writer.write(b)
                await writer.drain()
            writer.close()
        except Exception:  # a client gone: nothing to answer
            writer.close()

    def router():
        asyncio.set_event_loop(rloop)
        server = rloop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
        rport[0] = server.sockets[0].getsockname()[1]
        ready.set()
        rloop.run_forever()

    threading.Thread(target=router, daemon=True).start()
    ready.wait(10)
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 1.0, "daemon.flush_interval_s": 5.0,
        "proxy.listen": "127.0.0.1:0", "proxy.upstream": f"http://127.0.0.1:{rport[0]}", "metrics.listen": "",
        "scrape.server": "llamacpp", "daemon.restore_on_start": False, "tags.socket": str(tmp_path / "pp.sock")})
    daemon = Daemon(cfg, Rig("h200-141g", nvml=nvml, host=False))

    async def whole(s, url, tag):
        try:
            async with await cut_accuracy._post(s, url, tag, {"prompt": cut_accuracy._words(300), "max_tokens": 600,
                                                              "stream": False}) as r:
                await asyncio.wait_for(r.read(), 30.0)
        except aiohttp.ClientError:
            pass

    async def scene(url):
        await _server_known(daemon)
        async with aiohttp.ClientSession() as s:
            await cut_accuracy._normal(s, url, "warm")
            live = asyncio.create_task(whole(s, url, "live"))
            await asyncio.sleep(0.3)
            queued = asyncio.create_task(whole(s, url, "queued"))
            await asyncio.sleep(0.7)  # a good scrape after it arrived
            state["blip"] = True
            await asyncio.sleep(0.1)
            rloop.call_soon_threadsafe(state["close_queued"].set)
            await asyncio.sleep(0.6)
            state["blip"] = False
            await asyncio.gather(live, queued)

    try:
        _run_daemon(srv, daemon, scene, after_s=6)
    finally:
        rloop.call_soon_threadsafe(rloop.stop)
    truth = {t["client_id"]: t for t in srv.truth + srv.truth_cancelled if t.get("client_id")}
    rows = _rows_by_tag(tmp_path)
    assert "queued" not in truth  # the server never had it
    q, live = rows["queued"], rows["live"]
    print("queued", q["attributed_tokens"], q["gpu_energy_j"], "live", live["gpu_energy_j"], truth["live"]["energy_j"])
    assert q["status"] == 502 and not q["gpu_energy_j"] > 0 and not q["attributed_tokens"], q  # NaN: not costed
    assert "its process died" not in (q["energy_note"] or ""), q["energy_note"]
    # after: 1201-1220 J (+2% to +4%); before: 1074-1099 J (-7% to -9%)
    assert live["gpu_energy_j"] == pytest.approx(truth["live"]["energy_j"], rel=0.06), (live, truth["live"])


@pytest.mark.parametrize("bypass", [False, True])
def test_the_requests_beside_an_sglang_run_on_that_may_end_by_itself_are_flagged_not_silently_low(tmp_path, bypass):
    # The docs' scene: 24 streams ending by themselves (the simulator's end of text, 16-63 tokens in) 0.4 s apart beside
    # 4 streams cut after 5 chunks whose answers may end by themselves too (no ignore_eos). SGLang counts such a run-on
    # at its real end, unseen: its tokens read as bypass traffic in the scrape windows from its client's leave to its
    # abort, and the streams live there were -12% to -17%, their rows saying `complete` (162-168 bypass tokens where none
    # ran). Those windows now say run_on_may_end: their rows are flagged bypass-uncounted (out of J/token), and bypass
    # traffic beside them (480 tokens) is still read as it was, nothing listed or taken off.
    import asyncio

    import aiohttp

    from powerprof.storage.schema import UNSURE_FLAG

    srv, daemon = _h200_daemon(tmp_path, "sglang", decode_tok_s=40.0)
    post, normal = _tagged_stream, _stream_read_whole

    async def cut(s, url, tag):
        r = await post(s, url, tag, {"prompt": f"{tag} " * 300, "max_tokens": 2000})
        await _leave_after_events(r, 5)

    async def scene(url):
        await _until_run_ons_known(daemon)
        async with aiohttp.ClientSession() as s:
            jobs, nb = [], 0
            for k in range(24):
                jobs.append(asyncio.create_task(normal(s, url, k)))
                if k % 6 == 1:
                    jobs.append(asyncio.create_task(cut(s, url, f"cut{k}")))
                if bypass and k % 6 == 3:
                    jobs += [asyncio.create_task(_bypass_completion(s, srv.url, nb + j)) for j in range(3)]
                    nb += 3
                await asyncio.sleep(0.4)
            await asyncio.gather(*jobs)
            await asyncio.sleep(3.0)  # past the last abort and its windows: the streams after are no run-on's neighbours
            await asyncio.gather(*[asyncio.create_task(normal(s, url, 30 + k)) for k in range(4)])

    _run_daemon(srv, daemon, scene, after_s=6, up=lambda: "proxy" in daemon.urls, up_tries=400)
    truth = {t["client_id"]: t for t in [*srv.truth, *srv.truth_cancelled] if t.get("client_id")}
    rows = _rows_by_tag(tmp_path)
    ivs = read_dataset(tmp_path / "data", "intervals").to_dict("records")
    byp_tokens = sum(t["generated"] for c, t in truth.items() if c.startswith("byp"))
    read_tokens = sum(x.get("server_tokens") or 0 for x in ivs)
    read_j = sum(x.get("unproxied_energy_j") or 0 for x in ivs)
    cuts = [t for t in rows if t.startswith("cut")]
    assert len(cuts) == 4 and all(UNSURE_FLAG in (rows[t]["energy_note"] or "") for t in cuts), rows.keys()
    ok = {t: r for t, r in rows.items() if t.startswith("ok")}
    notes = {t: r["energy_note"] if isinstance(r["energy_note"], str) else "" for t, r in ok.items()}
    flagged = {t for t in ok if "bypass-uncounted" in notes[t]}
    err = _errors_shown(ok, truth)
    marked = [x for x in ivs if "run_on_may_end" in (x.get("server_count") or "")]
    print("bypass", byp_tokens, "read", round(read_tokens, 1), round(read_j, 1), "J; flagged", len(flagged),
          "of", len(ok), "; intervals marked", len(marked), "of", len(ivs),
          "; unflagged mean", round(100 * float(np.mean([e for t, e in err.items() if t not in flagged] or [0])), 1),
          "; flagged mean", round(100 * float(np.mean([e for t, e in err.items() if t in flagged] or [0])), 1),
          "; live J/token", daemon.ledger.totals.j_per_token, daemon.ledger.totals.jpt_left_out, "truth (all ok, late)",
          [sum(truth[t]["energy_j"] for t in ts) / sum(truth[t]["generated"] for t in ts)
           for ts in (list(ok), [f"ok{30 + k}" for k in range(4)])])
    assert byp_tokens == (480 if bypass else 0)
    assert marked, [x.get("server_count") for x in ivs]
    # Real bypass traffic is still read (not listed away): at least what ran, less the few a read's timing moves.
    assert read_tokens >= byp_tokens - 20, (read_tokens, byp_tokens)
    # No row is silently off: those live in a run-on's windows are flagged, with the reason; the streams after them not,
    # and they are right both ways (the stream after the last cut took a 0.93 s idle interval's energy while the idle
    # power was still unmeasured: +34% to +42%, unflagged, which the lower bound alone let pass). Each is a 0.4-1.6 s
    # stream on a counter refreshed every 100 ms, good to about a refresh at each edge (docs/daemon.md, Short sampling
    # intervals): -12% and +22% in one quiet run, so each is held to -25%..+30% and the four together to 10%.
    assert all("run_on_may_end" in notes[t] for t in flagged)
    assert not any("run_on_may_end" in notes[f"ok{30 + k}"] for k in range(4)), notes
    off = {t: round(err[t], 3) for t in ok if t not in flagged and not -0.25 < err[t] < 0.30}
    late = [f"ok{30 + k}" for k in range(4)]
    late_est, late_true = sum(ok[t]["gpu_energy_j"] for t in late), sum(truth[t]["energy_j"] for t in late)
    # The first stream after the quiet spell took that spell's idle energy where the idle median from MIN_IDLE on took
    # sub-refresh idle intervals in (0 W readings): ok30 +38% in about one run in three, unflagged; only runs of idle
    # intervals summed to workmodel.IDLE_MIN_S, with energy, teach it now.
    assert not off, off
    assert late_est == pytest.approx(late_true, rel=0.10), (late_est, late_true)


def test_a_cut_stream_beside_streams_with_no_server_scraped_flags_them_naming_scrape_server(tmp_path):
    # scrape.server = none: the daemon knows no server kind, so SGLang's run-on of a cut stream (to its abort 2 s after
    # the leave) is not placed, and its work went to the streams beside it, their rows unflagged (docs/daemon.md: the
    # run_on_may_end scene, 0 of 24 flagged, up to +35.6%). Now the cut row and those beside it until such a run-on
    # must have ended say uncertain-uncounted with the fix (scrape.server); the streams sent well after are unflagged.
    import asyncio

    import aiohttp

    from powerprof.storage.schema import UNSURE_FLAG

    srv, daemon = _h200_daemon(tmp_path, "sglang", overrides={"scrape.server": "none"}, decode_tok_s=40.0)

    async def cut(s, url, tag):
        r = await _tagged_stream(s, url, tag, {"prompt": f"{tag} " * 300, "max_tokens": 2000, "ignore_eos": True})
        await _leave_after_events(r, 5)

    async def scene(url):
        async with aiohttp.ClientSession() as s:
            jobs = [asyncio.create_task(_stream_read_whole(s, url, k)) for k in range(3)]
            jobs.append(asyncio.create_task(cut(s, url, "cut")))
            await asyncio.sleep(0.4)
            jobs += [asyncio.create_task(_stream_read_whole(s, url, k)) for k in range(3, 6)]
            await asyncio.gather(*jobs)
            await asyncio.sleep(5.0)  # past any run-on's end: the streams after are nobody's neighbours
            await asyncio.gather(*[asyncio.create_task(_stream_read_whole(s, url, 30 + k)) for k in range(3)])

    _run_daemon(srv, daemon, scene, after_s=4, up=lambda: "proxy" in daemon.urls, up_tries=400)
    truth = {t["client_id"]: t for t in [*srv.truth, *srv.truth_cancelled] if t.get("client_id")}
    rows = _rows_by_tag(tmp_path)
    assert daemon.scraper is None and truth["cut"]["generated"] > 30, truth["cut"]  # it ran on for nobody
    notes = {t: r["energy_note"] if isinstance(r["energy_note"], str) else "" for t, r in rows.items()}
    err = _errors_shown({t: r for t, r in rows.items() if t.startswith("ok") or t == "cut"}, truth)
    print({t: notes[t][:160] for t in sorted(notes)})
    said = {t for t, n in notes.items() if UNSURE_FLAG in n and "scrape.server" in n}
    assert "cut" in said, notes["cut"]
    # Those live after the leave: each one's share there may hold the run-on's work (+10% or more before, unflagged).
    left = rows["cut"]["t_end_utc"]
    beside = {t for t in rows
              if t.startswith("ok") and t not in ("ok30", "ok31", "ok32") and rows[t]["t_end_utc"] > left}
    assert beside and beside <= said, (beside, said, {t: round(err[t], 2) for t in beside})
    assert not any(f"ok3{k}" in said for k in range(3)), said
    # The live J/token gauge leaves those intervals out, said by reason (before: kept, 2.567 for the truth's 2.154, none
    # left out).
    n_iv, n_tok = daemon.ledger.totals.jpt_left_out.get(UNSURE_FLAG, (0, 0.0))
    assert n_iv > 0 and n_tok > 0, daemon.ledger.totals.jpt_left_out


def test_a_whole_answer_cut_with_no_server_scraped_flags_those_beside_it_to_its_max_tokens_end(tmp_path):
    # scrape.server = none beside the simulated llama.cpp: a whole answer (max_tokens 2000 at 40 tok/s) cut 1.5 s in
    # runs on for nobody while a stream a second keeps llama-server's 1 s wait for a result from timing out. Before, its
    # span was capped at RUN_ON_TO_END_MAX_S + 1 s: the rows ending 34-56 s after the leave +64..+144%, unflagged. Now
    # every row beside it is flagged to its max_tokens' end at half the pace (100 s here): the streams after 4 quiet
    # seconds too, though this (recent) llama-server cancelled it there: with the kind unknown, a server that runs it
    # on to its end cannot be told apart (the next test).
    import asyncio
    import time

    import aiohttp

    from powerprof.storage.schema import UNSURE_FLAG

    srv, daemon = _h200_daemon(tmp_path, "llamacpp", overrides={"scrape.server": "none"}, decode_tok_s=40.0)
    left = {}

    async def cut(s, url):
        try:
            await asyncio.wait_for(s.post(url + "/v1/completions", json={
                "model": "m", "prompt": "cut " * 300, "max_tokens": 2000, "ignore_eos": True},
                headers={"X-Sim-Request-Id": "cut", "X-Powerprof-Tag": "cut"}), 1.5)
        except asyncio.TimeoutError:
            pass
        left["t"] = time.monotonic()

    async def scene(url):
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*[_stream_read_whole(s, url, k) for k in range(3)])  # the pace
            await cut(s, url)
            jobs = []
            for k in range(36):  # a stream a second: no quiet second, the run-on goes on past 31 s
                jobs.append(asyncio.create_task(_stream_read_whole(s, url, 100 + k)))
                await asyncio.sleep(1.0)
            await asyncio.gather(*jobs)
            await asyncio.sleep(4.0)  # quiet: this llama-server's wait times out and it cancels the run-on
            await asyncio.gather(*[_stream_read_whole(s, url, 200 + k) for k in range(3)])

    _run_daemon(srv, daemon, scene, after_s=4)
    truth = {t["client_id"]: t for t in [*srv.truth, *srv.truth_cancelled] if t.get("client_id")}
    rows = _rows_by_tag(tmp_path)
    notes = {t: r["energy_note"] if isinstance(r["energy_note"], str) else "" for t, r in rows.items()}
    err = _errors_shown({t: r for t, r in rows.items() if t.startswith("ok")}, truth)
    said = {t for t, n in notes.items() if UNSURE_FLAG in n and "scrape.server" in n}
    beside = [f"ok{100 + k}" for k in range(36)]
    after = {t: (rows[t]["t_end_utc"] - rows["cut"]["t_end_utc"]).total_seconds() for t in beside}
    print({t: (round(after.get(t, 0), 1), round(err[t], 2), t in said) for t in sorted(err)})
    assert 1000 < truth["cut"]["generated"] < 2000, truth["cut"]  # ran on past 31 s for nobody, cancelled at the quiet
    assert "cut" in said and max(after.values()) > 33, (notes["cut"], after)
    assert set(after) <= said, sorted(set(after) - said)  # before: those ending past 31 s unflagged
    # Within its max_tokens' span: flagged, over-flagged here (scrapefix6 ended the span at the quiet, the next test's
    # older server then left +29..+70% unflagged).
    assert all(f"ok{200 + k}" in said for k in range(3)), said


def test_a_whole_answer_cut_with_no_server_scraped_on_a_server_that_never_cancels_it_flags_those_after_a_quiet(
        tmp_path, monkeypatch):
    # An older llama-server (before the fix of ggml-org/llama.cpp#9273, or the #24496 regression; ik_llama.cpp before
    # its #1134): a whole answer's HTTP thread never looks at its client, so it runs to its max_tokens (560 at 40 tok/s,
    # 14 s) whatever the quiet. Ended at the first quiet second (scrapefix6), the streams sent 4.5 s after the leave and
    # ending 6.6-10.7 s after it read +29..+70%, unflagged; all flagged before that change, and now.
    import asyncio

    import aiohttp

    from powerprof.sim import server as simserver
    from powerprof.storage.schema import UNSURE_FLAG

    looks = simserver.SimServer._llamacpp_looks
    monkeypatch.setattr(simserver.SimServer, "_llamacpp_looks",
                        lambda self, c, now, poll_s: looks(self, c, now, poll_s) if c.streamed else False)
    srv, daemon = _h200_daemon(tmp_path, "llamacpp", overrides={"scrape.server": "none"}, decode_tok_s=40.0)

    async def scene(url):
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*[_stream_read_whole(s, url, k) for k in range(3)])  # the pace
            try:
                await asyncio.wait_for(s.post(url + "/v1/completions", json={
                    "model": "m", "prompt": "cut " * 300, "max_tokens": 560, "ignore_eos": True},
                    headers={"X-Sim-Request-Id": "cut", "X-Powerprof-Tag": "cut"}), 1.5)
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(4.5)  # no proxied result: a recent llama-server would cancel it here, this one does not
            jobs = []
            for k in range(12):
                jobs.append(asyncio.create_task(_stream_read_whole(s, url, 100 + k)))
                await asyncio.sleep(0.5)
            await asyncio.gather(*jobs)

    _run_daemon(srv, daemon, scene, after_s=4)
    truth = {t["client_id"]: t for t in [*srv.truth, *srv.truth_cancelled] if t.get("client_id")}
    rows = _rows_by_tag(tmp_path)
    notes = {t: r["energy_note"] if isinstance(r["energy_note"], str) else "" for t, r in rows.items()}
    err = _errors_shown({t: r for t, r in rows.items() if t.startswith("ok")}, truth)
    said = {t for t, n in notes.items() if UNSURE_FLAG in n and "scrape.server" in n}
    print({t: (round(err[t], 2), t in said) for t in sorted(err)})
    assert truth["cut"]["generated"] == 560, truth["cut"]  # run to its end for nobody, the quiet notwithstanding
    after = [f"ok{100 + k}" for k in range(12)]
    assert "cut" in said and set(after) <= said, sorted(set(after) - said)  # before: ok103-ok111 +29..+70%, unflagged
