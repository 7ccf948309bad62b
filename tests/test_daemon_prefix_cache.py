"""Multi-turn chat on a server with prefix caching, through the daemon: each turn resends the whole conversation and
the server computes only its new part; the daemon costs a turn's prefill at the part computed (the cached count each
dialect gives), against the simulator's truth per request (bench/_attribution.py conversation_trace)."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from _attribution import conversation_trace, run_mixed, score_mixed  # noqa: E402
from support import side_by_side  # noqa: E402

pytestmark = pytest.mark.slow

SERVER = {"prefix_cache": True, "prompt_details": True}
FLAG = "prefix-cache-unsaid"  # storage/schema.py CACHE_UNSAID_FLAG


def _long_turns():
    """Long cached turns (600 tokens) beside single chats."""
    from powerprof.workload.trace import TraceRequest

    return [TraceRequest(r.t_s, r.prompt_tokens, 600 if r.tag != "chat" else r.output_tokens, r.tag)
            for r in conversation_trace(6, 6, 60, 6.0)]


def _band_of(rows: pd.DataFrame) -> tuple[float, float]:
    """The rows' summed error against their truth with each row's figure at the low, then the high, end of the work
    model's context cost band its note states (rowtext.CTX_BAND_NOTE; a row with none at its figure): the truth lies
    between where the first is ≤ 0 ≤ the second."""
    ends = rows["energy_note"].fillna("").str.extract(
        r"standard errors: across them .*? its figure moves by ([-+]\d+)% to ([-+]\d+)%").astype(float).fillna(0.0)
    e, true_j = rows["gpu_energy_j"].fillna(0.0), rows["true_j"].sum()
    return tuple(float((e * (1 + ends[k] / 100)).sum() / true_j - 1) for k in (0, 1))


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The module's five scenes, three at a time, each its own simulated server and daemon in a process of its own
    (tests/support.py side_by_side). end_run and late_run, module fixtures of their own, ran after the first three, one
    after the other (~51 s each); in the pool they run beside the live-daemon tests."""
    trace = conversation_trace(10, 10, 150, 6.0)
    return side_by_side(request, {
        # llama-server: timings.cache_n beside the chat usage; vLLM: usage.prompt_tokens_details.cached_tokens.
        **{f: (run_mixed, (trace,), dict(data_dir=tmp_path_factory.mktemp(f), flavour=f, server=SERVER))
           for f in ("llamacpp", "vllm")},
        # vLLM as started by default: automatic prefix caching on, no --enable-prompt-tokens-details.
        "vllm-unsaid": (run_mixed, (trace,), dict(data_dir=tmp_path_factory.mktemp("vllm-unsaid"), flavour="vllm",
                                                  server=dict(SERVER, prompt_details=False))),
        # Long cached turns beside single chats, vLLM with the details flag, chat streams asking continuous usage:
        # most turns' prefill intervals close before their end says their cached count.
        "late_run": (run_mixed, (_long_turns(),), dict(data_dir=tmp_path_factory.mktemp("late"), flavour="vllm",
                                                       server=SERVER, continuous=True)),
        # The same trace without continuous usage: each stream says its prompt and its cached count at its end, its
        # prefill's intervals held for them (the prompt hold).
        "end_run": (run_mixed, (_long_turns(),), dict(data_dir=tmp_path_factory.mktemp("end"), flavour="vllm",
                                                      server=SERVER)),
    }, max_processes=3)


@pytest.mark.parametrize("flavour", ["llamacpp", "vllm"])
def test_turns_of_a_cached_conversation_are_costed_at_the_prefill_they_caused(runs, flavour):
    o = runs[flavour].result()
    s = score_mixed(o)
    turns = o.requests[(o.requests["kind"] == "turn") & o.requests["true_j"].notna()]
    # Most of each turn's prompt was cached (the truth says so) and the server said how much.
    assert turns["true_cached"].sum() > 0.8 * turns["prompt_tokens"].sum()
    assert abs(s["conservation_err"]) <= 0.001
    # Before (their whole prompts costed as prefill, the chats beside them paying), llama.cpp: turns +22.5% in sum
    # (median |error| 21%, p95 99%), chats -9.2%; after: +2.8% (8.6%, 28%), -1.0% (docs/daemon.md, "Prompts are known").
    for kind in ("turn", "chat"):
        m = s["kinds_all"][kind]
        assert m["n"] >= 90 and m["no_share"] == 0, (kind, m)
        # Real-time replay on a loaded host moves these by several % run to run (seen: turns +8.0%, median 15%; 16 runs
        # two side by side, turns -2.9% to +10.1%; a full suite on 2 cores once +12.2%). Before the fix +22.5%. Beside
        # CPU hogs the fit trades its decode and context costs (turns -7.4% to +15.4%, chats the other way): an error
        # past 15% must be one the rows said, the truth between their figures' sums at the context cost band's ends.
        lo, hi = _band_of(o.requests[(o.requests["kind"] == kind) & o.requests["true_j"].notna()])
        assert abs(m["sum_err"]) < 0.15 or lo <= 0.02 and hi >= -0.02, (kind, m, lo, hi)
    rows = o.requests
    if flavour == "vllm":
        # The server said every cached count: nothing is flagged, and the rows carry the counts (the truth's).
        assert not rows["energy_note"].fillna("").str.contains(FLAG).any()
        assert not o.intervals["energy_note"].fillna("").str.contains(FLAG).any()
        said = rows[rows["true_j"].notna()]
        assert (said["cached_prompt_tokens"] == said["true_cached"]).all()


@pytest.mark.parametrize("run", ["vllm-unsaid"])
def test_cached_prompts_a_server_does_not_say_are_flagged_with_the_fix(runs, run):
    """vLLM without --enable-prompt-tokens-details (its default, with prefix caching on) says no cached count: each
    turn's prompt is costed as computed whole. Its /metrics vllm:prefix_cache_hits_total says hits happened: the
    rows say the figures are approximate, why and the fix, rather than nothing."""
    o = runs[run].result()
    s = score_mixed(o)
    rows = o.requests[o.requests["true_j"].notna()]
    turns = rows[(rows["kind"] == "turn") & (rows["true_cached"] > 0)]
    assert turns["true_cached"].sum() > 0.8 * turns["prompt_tokens"].sum()
    assert abs(s["conservation_err"]) <= 0.001
    # The server did not say: the column is null, never a 0 that reads as "nothing cached".
    assert rows["cached_prompt_tokens"].isna().all()
    # The figures are off (the turns over-charged, measured +15% in sum, the chats beside them -6%: docs/daemon.md) ...
    assert s["kinds_all"]["turn"]["sum_err"] > 0.05, s["kinds_all"]["turn"]
    # ... and said: every cached turn's row, with the reason and the fix; most chats beside them (live in windows of
    # unsaid hits); the intervals with prefill there; and counted for /metrics (powerprof_requests_cache_unsaid_total).
    note = turns["energy_note"].fillna("")
    flagged = note.str.contains("approximate: ") & note.str.contains(FLAG) & note.str.contains(
        "--enable-prompt-tokens-details")
    assert flagged.mean() >= 0.95, note[~flagged].head(3).tolist()
    chats = rows[rows["kind"] == "chat"]["energy_note"].fillna("")
    assert chats.str.contains(FLAG).mean() > 0.5
    busy = o.intervals[o.intervals["prefill_tokens"] > 0]
    assert busy["energy_note"].fillna("").str.contains(FLAG).mean() > 0.5
    flagged_rows = int(o.requests["energy_note"].fillna("").str.contains(FLAG).sum())
    assert f"prefix-cache-unsaid requests: {flagged_rows}" in o.notes, o.notes[-1]


@pytest.mark.parametrize("details", [True, False], ids=["details", "no-details"])
def test_a_live_daemon_stores_the_said_counts_and_counts_the_unsaid_on_metrics(tmp_path, details):
    # A daemon process in front of the simulated vLLM, one conversation (turns streamed and whole), as
    # tests/test_real_vllm.py runs it in front of vLLM 0.32. Said: the rows carry the counts, nothing flagged. Not said:
    # the cached turns are flagged, their cached_prompt_tokens null, and /metrics counts them. Before: the whole
    # turn's row said 384 cached (the simulated vLLM's whole answers carried llama.cpp's timings.cache_n, which vLLM
    # never sends) and powerprof_requests_cache_unsaid_total read 0 with 2 rows flagged (never passed to /metrics).
    from daemon_helpers import daemon_conversation, note_of

    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    # A cached turn's prefill of ~0.5 s (it computes ~25 tokens), longer than the daemon's 0.25 s scrape: vLLM
    # publishes a request's prefix-cache hit with its prefill step's output, so the counter rises then, not at its
    # arrival. Before, a whole (non-streamed) answer's hit was looked for at its arrival alone (its first token unseen):
    # the rise, a window later, was matched to the next turn's said count, and that turn's own hit read unsaid (vLLM
    # 0.32: said-1 and said-2 flagged with every count said; without the flag, the whole turn's own prompt not flagged).
    # (chat-0 computes its whole prompt: ~8 s.)
    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", decode_tok_s=200, prefill_tok_s=50,
                   model="tiny", prefix_cache=True, prompt_details=details) as sim:
        rows, usages, unsaid = daemon_conversation(sim.url, tmp_path, "chat")
    flagged = [tag for tag, r in rows.items() if FLAG in note_of(r)]
    if details:
        cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), usages
        assert [rows[f"chat-{k}"]["cached_prompt_tokens"] for k in range(3)] == cached
        assert flagged == [] and unsaid == 0
    else:
        assert all(pd.isna(r["cached_prompt_tokens"]) for r in rows.values()), rows
        assert {"chat-1", "chat-2"} <= set(flagged), {t: note_of(r) for t, r in rows.items()}
        # Each cached turn's own prompt, the whole answer's too: not only a share beside another's (which hangs on
        # where the intervals fall; vLLM 0.32's whole turn was flagged for neither in one run of two).
        for tag in ("chat-1", "chat-2"):
            assert "in the scrape window(s) over its prefill" in note_of(rows[tag]), note_of(rows[tag])
        assert unsaid == len(flagged)


@pytest.mark.parametrize("version", ["v0.8", "v0.9"])
def test_early_vllm_v1_counters_flag_the_hits_its_answers_do_not_say(tmp_path, version):
    # vLLM 0.8.0-0.9.1 names its hits vllm:gpu_prefix_cache_hits_total (blocks in 0.8, tokens in 0.9). Before, the
    # daemon read only vllm:prefix_cache_hits_total: on those versions the cached turns' prompts were costed whole, their
    # rows silent (0 flagged, powerprof_requests_cache_unsaid_total 0).
    from daemon_helpers import daemon_conversation, note_of

    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", decode_tok_s=200, prefill_tok_s=50,
                   model="tiny", prefix_cache=True, prompt_details=False, vllm_metrics=version) as sim:
        rows, _usages, unsaid = daemon_conversation(sim.url, tmp_path, "chat")
    flagged = [tag for tag, r in rows.items() if FLAG in note_of(r)]
    assert {"chat-1", "chat-2"} <= set(flagged), {t: note_of(r) for t, r in rows.items()}
    assert unsaid == len(flagged)


LATE = "prefix-cache-late"  # storage/schema.py CACHE_LATE_FLAG
EDGE_S = 0.01  # a work overlap this short (s) with an interval is left to the ledger's own test


def test_a_live_daemon_counts_cached_counts_said_late_on_metrics(tmp_path):
    # vLLM with the details flag, streams asking continuous usage: each running usage says the prompt's length, only
    # the final one its cached count (as vLLM 0.32's do). A third turn decoding 3 s outlives the intervals over its
    # prefill, which close with its whole prompt costed as computed: its row says prefix-cache-late, and /metrics
    # counts every row that says it. Before: no powerprof_requests_cache_late_total at all.
    from daemon_helpers import daemon_conversation, note_of

    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", decode_tok_s=200, model="tiny",
                   prefix_cache=True, prompt_details=True) as sim:
        rows, usages, late = daemon_conversation(sim.url, tmp_path, "late", metric="powerprof_requests_cache_late_total",
                                                 continuous=True, max_tokens=600)
    assert usages[2]["prompt_tokens_details"]["cached_tokens"] > 0, usages
    note = note_of(rows["late-2"])
    assert LATE in note and "fix:" in note, {t: note_of(r) for t, r in rows.items()}
    flagged = [t for t, r in rows.items() if LATE in note_of(r)]
    assert late == len(flagged), (late, flagged)


@pytest.fixture(scope="module")
def late_run(runs):
    return runs["late_run"].result()


@pytest.fixture(scope="module")
def end_run(runs):
    return runs["end_run"].result()


@pytest.mark.parametrize("run", ["end_run", "late_run"])
def test_a_server_that_says_every_cached_count_gets_no_unsaid_flag(request, run):
    # The server's prefix-cache counter counts a hit as it schedules a request; a stream says it at its end, seconds
    # later. Before, a scrape window read between the two passed those hits for unsaid: said at the end, 35 of 96
    # requests (21 turns, 14 chats) and 2 of 59 intervals said prefix-cache-unsaid; said late (continuous usage), 92
    # requests and 17 intervals, beside their prefix-cache-late. Its fix, the details flag, was on all along.
    o = request.getfixturevalue(run)
    rows = o.requests[o.requests["true_j"].notna()]
    assert len(rows) == 96 and rows["true_cached"].sum() > 0
    assert (rows["cached_prompt_tokens"] == rows["true_cached"]).all()  # every count said (the truth's)
    note = o.requests["energy_note"].fillna("")
    assert not note.str.contains(FLAG).any(), note[note.str.contains(FLAG)].head(3).tolist()
    assert not o.intervals["energy_note"].fillna("").str.contains(FLAG).any()
    assert "prefix-cache-unsaid requests: 0" in o.notes, o.notes


def test_the_requests_beside_a_cached_count_said_late_are_marked(late_run):
    o = late_run
    rows = o.requests[o.requests["true_j"].notna()]
    note = rows["energy_note"].fillna("")
    own = note.str.contains(LATE + r": its answer said", regex=True)
    assert own.sum() >= 5, note.tolist()[:5]  # turns said late (30 of 36 seen)
    late = rows[own]
    # The intervals with a late turn's prefill (its arrival to its first token) in them, and the requests that worked
    # there (arrival to last token) for more than EDGE_S: those took a share of their energy. Live there to its end (the
    # flake: 1 quiet CI run), a chat whose last token came before such an interval took none, and its row rightly says
    # nothing of it; the edge itself is test_prefix_cache_ledger.py's (rows' times are wall-clock, the ledger's not).
    ivs = o.intervals[[bool(((late["t_arrival_utc"] < e) & (late["t_first_utc"] > s)).any())
                       for s, e in zip(o.intervals["t_start_utc"], o.intervals["t_end_utc"])]]
    worked_s = [((ivs["t_end_utc"].clip(upper=x["t_last_utc"]) - ivs["t_start_utc"].clip(lower=x["t_arrival_utc"]))
                 .dt.total_seconds().max()) for _, x in rows.iterrows()]
    beside = rows[[not own[i] and w > EDGE_S for i, w in zip(rows.index, worked_s)]]
    assert len(beside) >= 10
    # Before: none of them said anything of it (measured 0 of 61). Now every one is marked, with the fix.
    said = beside["energy_note"].fillna("").str.contains(LATE + ": up to", regex=False)
    assert said.all(), beside.loc[~said, "energy_note"].head(3).tolist()
    assert beside["energy_note"].str.contains("fix:").all()
    flagged = int(o.requests["energy_note"].fillna("").str.contains(LATE).sum())
    assert f"prefix-cache-late requests: {flagged}" in o.notes, o.notes[-1]
