"""The daemon's per-request energy by API kind against the simulator's truth: chat, n = 2 chat, Anthropic messages,
OpenAI responses and embeddings beside each other (the small version of bench/attribution_mixed.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from _attribution import SGLANG_KINDS, SGLANG_WEIGHTS, mixed_trace, run_mixed, score_mixed  # noqa: E402
from support import side_by_side  # noqa: E402

from powerprof.storage.schema import BYPASS_LOW_FLAG, bypass_count_low  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The three flavours' runs at once, each in its own process (tests/support.py side_by_side): 80 s, not 175 s."""
    return side_by_side(request, {
        "outcome": (run_mixed, (mixed_trace(300, 8.0, seed=5),), dict(data_dir=tmp_path_factory.mktemp("mixed"))),
        # 800 requests: the fit matures after about 275 of them here (300 leave 7 scored), but under a loaded
        # full suite (four workers and these three runs on 2 cores) after nearly 600: a 600-request run then scored
        # no n = 2 chat at all.
        "vllm_outcome": (run_mixed, (mixed_trace(800, 8.0, seed=5),),
                         dict(data_dir=tmp_path_factory.mktemp("mixed-vllm"), flavour="vllm")),
        "sglang_outcome": (run_mixed, (mixed_trace(300, 8.0, seed=5, kinds=SGLANG_KINDS, weights=SGLANG_WEIGHTS),),
                           dict(data_dir=tmp_path_factory.mktemp("mixed-sglang"), flavour="sglang")),
        "sglang_n2": (run_mixed, (_long_prompts_n2(),), dict(data_dir=tmp_path_factory.mktemp("sglang-n2"),
                                                             flavour="sglang")),
    })


def _long_prompts_n2():
    """Long prompts (1500-3000 tokens) and short answers (8-24 tokens), a third n = 1 /generate, a third n = 2
    /generate, a sixth n = 2 chat, a sixth n = 2 /generate of one prompt every time (`generate_n2_again`)."""
    from powerprof.workload.trace import TraceRequest

    rng = np.random.default_rng(3)
    kinds = ["generate", "generate_n2", "chat_n2", "generate", "generate_n2", "generate_n2_again"]
    t = np.cumsum(rng.exponential(1 / 3.0, 120))
    return [TraceRequest(float(t[i]), int(rng.integers(1500, 3000)), int(rng.integers(8, 24)), kinds[i % 6])
            for i in range(120)]


# What a row says of a host that ran the proxy late: its energy may be in `unproxied` (the proxy's lag read as bypass
# tokens) or its tokens were read in bursts, each spread over the time before it.
READ_LATE = (BYPASS_LOW_FLAG, "reached the proxy in")


def _read_in_time(o, kind: str):
    """A kind's rows with a truth, and those of them that say nothing of READ_LATE."""
    r = o.requests[(o.requests["kind"] == kind) & o.requests["true_j"].notna()]
    late = r["energy_note"].fillna("").str.contains("|".join(READ_LATE))
    return r, r[~late]


def _sum_err(o, kind, bound, guard):
    """The kind's summed energy error and its bound: over the rows not read late where they are at least half, `bound`;
    else over every row, `guard`, a regression's bound only (a host that ran the proxy late on most rows moves their
    fixed-ratio split far, as they say: all rows -15% to +19% beside CPU hogs, -49% once in CI, -100% with no share)."""
    every, judged = _read_in_time(o, kind)
    rows, b = (judged, bound) if len(judged) >= 0.5 * len(every) else (every, guard)
    return rows["gpu_energy_j"].sum() / rows["true_j"].sum() - 1.0, b, f"{len(rows)} of {len(every)} rows"


def _unproxied_split(o):
    """Unproxied energy in intervals whose count is trusted (`complete`), in those whose count may be off
    (schema.bypass_count_low), and the latter's rows that do not say so (BYPASS_LOW_FLAG in energy_note)."""
    iv = o.intervals
    low = np.array([bypass_count_low(c) for c in iv["server_count"]], dtype=bool)
    held = iv["unproxied_energy_j"].fillna(0.0) > 0
    unsaid = iv[low & held & ~iv["energy_note"].fillna("").str.contains(BYPASS_LOW_FLAG)]
    return (float(iv.loc[~low, "unproxied_energy_j"].sum()), float(iv.loc[low, "unproxied_energy_j"].sum()),
            unsaid[["t_start_utc", "server_count", "unproxied_energy_j", "energy_note"]])


@pytest.fixture(scope="module")
def outcome(runs):
    o = runs["outcome"].result()
    return o, score_mixed(o)


def test_embeddings_get_the_energy_of_their_forward_pass(outcome):
    # Before: no embeddings request got any energy (-100%, every row "no share: not counted"), and theirs went to the
    # generations beside them. bench/attribution_mixed.py, 800 requests: -1.2% sum, p95 14.9% once the fit is mature;
    # over all requests (the warm-up's fixed ratio included) -7.8%.
    o, s = outcome
    emb = s["kinds_all"]["embeddings"]
    assert emb["n"] >= 20 and emb["no_share"] == 0
    assert not any(n.startswith("uncounted embeddings") for n in s["notes"]), s["notes"]
    rows = o.requests[o.requests["kind"] == "embeddings"]
    assert (rows["prompt_tokens"] > 0).all() and rows["generated_tokens"].isna().all()
    # Judged where at least half its rows say nothing of a host that ran the proxy late (READ_LATE), over those, else
    # every row against a regression's bound (_sum_err; asking 4 in 5 skipped the kinds on a quiet host too, 18-23% of
    # chat's rows not read late there, all rows -3.2%, chat_n2 +5.6%):
    # the split the 25% is for is the fixed ratio's (every row of this short trace says so: its fit matures late), which
    # its note says has no bound, and on a loaded host the proxy's lag reads as bypass tokens (`proxy_lag`) and the
    # ratio's split of these prompt-only requests among the late-read streams beside them moves far, the rows saying
    # both. Beside 2 CPU hogs and other jobs (load 6-15 on 2 cores), all 46 rows -15.8% (41 `bypass-uncounted`: -17.7%,
    # 5 not: -4.8%) and +18.9% (all 46 flagged); beside other jobs alone (load ~10) -21.8% and -22.4% (43 and 46
    # flagged); CI saw -49%.
    err, bound, n = _sum_err(o, "embeddings", 0.25, 0.6)
    assert abs(err) < bound, (err, bound, n, emb)


def test_every_kind_is_near_its_truth_and_every_joule_lands_somewhere(outcome):
    o, s = outcome
    assert abs(s["conservation_err"]) <= 0.001
    # With no bypass traffic here, the requests' energy is theirs and that of the unproxied intervals whose count may
    # be off, which say so (`proxy_lag` on a loaded host: the proxy's lag read as bypass tokens). The requests alone
    # read -4.5% and -4.6% beside 2 CPU hogs and other jobs (load 6-15 on 2 cores), -9.1% in the test beside them;
    # with that unproxied energy +0.3% to +1.0% in 5 runs (none in `complete` intervals).
    complete_j, flagged_j, unsaid = _unproxied_split(o)
    assert not len(unsaid), unsaid
    assert complete_j <= 0.02 * s["requests_true_j"], (complete_j, flagged_j, s["requests_true_j"])
    assert s["requests_est_j"] + flagged_j == pytest.approx(s["requests_true_j"], rel=0.05), (s["requests_est_j"],
                                                                                               flagged_j)
    for kind in ("chat", "chat_n2", "messages", "responses"):
        m = s["kinds_all"][kind]
        assert m["n"] >= 20 and m["no_share"] == 0, (kind, m)
        notes = o.requests.loc[o.requests["kind"] == kind, "energy_note"].dropna()
        assert not notes.str.contains("does not count").any()  # the embeddings beside them are no unseen work
        # 800 requests, all: -0.6%, +1.1%, +0.6%, -0.1% (before the sequences fix: -2.6%, +4.1%, -0.5%, -1.1%;
        # before the embeddings fix: +1.5%, +6.8%, +2.9%, +3.5%). Judged as the embeddings are, where the host did
        # not run the proxy late: beside 2 CPU hogs, all rows read late, messages -15.1% once.
        err, bound, n = _sum_err(o, kind, 0.15, 0.3)
        assert abs(err) < bound, (kind, err, bound, n, m)


def test_rows_split_before_the_fit_is_mature_say_so(outcome):
    # Until the work model's fit is mature the fixed ratio splits the intervals the requests share, and their rows say
    # so; once it is mature (and stays so) none does.
    o, s = outcome
    r = o.requests[o.requests["gpu_energy_j"] > 0]
    fixed = r["energy_note"].fillna("").str.contains("split among them by the fixed ratio")
    costs = o.costs.sort_values("time_utc")
    mature = costs[costs["mature"]]
    t_mature = mature["time_utc"].min() if len(mature) else None
    before = r["t_end_utc"] < t_mature if t_mature is not None else np.ones(len(r), bool)
    assert before.sum() >= 20
    assert fixed[before].mean() >= 0.8, r.loc[before & ~fixed, ["request_id", "energy_note"]]
    if t_mature is not None and costs.loc[costs["time_utc"] >= t_mature, "mature"].all():
        assert not fixed[r["t_arrival_utc"] > t_mature].any()


@pytest.fixture(scope="module")
def vllm_outcome(runs):
    o = runs["vllm_outcome"].result()
    return o, score_mixed(o)


def test_vllms_two_choices_are_costed_at_each_choices_whole_prompt(vllm_outcome):
    # vLLM says an n = 2 prompt once (computed once; the other choice hits the prefix cache), llama.cpp once per
    # choice. Before, vLLM's was divided by the two choices as llama.cpp's sum is: each choice's tokens costed at half
    # its prompt's context, n = 2 chat under its truth (bench/attribution_mixed.py --flavour vllm, 800 requests,
    # scored: -5.0% sum, median 4.5%, p95 11.2%; after: -0.4%, 2.1%, 5.9%; a trace of 600: -4.5% -> -0.5%).
    o, s = vllm_outcome
    assert abs(s["conservation_err"]) <= 0.001
    every = s["kinds_all"]["chat_n2"]
    assert every["n"] >= 60 and every["no_share"] == 0, every  # the rows are there and were given energy, fit or not
    costs = o.costs.sort_values("time_utc")
    t_mature = costs.loc[costs["mature"], "time_utc"].min() if costs["mature"].any() else None
    n2 = o.requests[(o.requests["kind"] == "chat_n2") & o.requests["true_j"].notna()]
    m = s["kinds"].get("chat_n2")
    if t_mature is None or (n2["t_arrival_utc"] >= t_mature).sum() < 15:
        # The split checked here is the fitted context cost's, which the fixed ratio before the fit is mature has not;
        # on a loaded host the fit may mature late or never (R² under 0.9 with the proxy's late reads). The rule itself
        # is held exactly by test_daemon_ledger.py::test_a_prompt_said_once_for_its_choices_is_each_choices_context_and
        # _one_prefill, and the rows split by the fixed ratio say so (test_rows_split_before_the_fit_is_mature_say_so).
        when = (f"never mature, its latest fit: {costs['not_mature_reason'].iloc[-1] if len(costs) else 'none'}"
                if t_mature is None else
                f"mature once {(o.requests['t_arrival_utc'] < t_mature).sum()} of {len(o.requests)} requests had arrived")
        after = 0 if t_mature is None else int((n2["t_arrival_utc"] >= t_mature).sum())
        pytest.skip(f"the work model's fit matured too late to score n = 2 chat ({after} of {every['n']} arrived after "
                    f"it; {when}): a host too loaded for it")
    assert m is not None and m["n"] >= 15 and m["no_share"] == 0, m
    assert (n2["prompt_tokens"] > 0).all()  # the prompt once, as the server said it
    # Judged: the rows whose figure the daemon says is whole (no energy_note: docs/data.md). On a loaded host the proxy
    # reads streams late and the rows say so: `approximate:` (read in bursts, each spread over the time before it) or
    # `bypass-uncounted:` (their intervals' server count `proxy_lag`: the proxy's own lag may be in it), their figures
    # off by that, not by the split checked here. Reproduced beside a loaded suite and CPU hogs (load 8-10 on 2 cores):
    # the fit mature once 657 of 800 requests had arrived, 21 n = 2 rows scored, -2.7% against this 2.5% bound (CI
    # saw 3.0%), and every one flagged: 14 `bypass-uncounted` (-4.2%), 7 `approximate:` (-0.3%); in that run and two
    # more all 800 rows carried a note. Those are left to the rows' flags; a host too loaded for any whole row skips.
    scored = n2[n2["t_arrival_utc"] >= t_mature]
    whole = scored[scored["energy_note"].isna()]
    if len(whole) < 15:
        pytest.skip(f"{len(whole)} of the {len(scored)} n = 2 chat rows scored carry no energy_note (the rest say their "
                    f"figure may be off: read late or beside `proxy_lag` counts, a loaded host): too few to judge the split")
    err = whole["gpu_energy_j"].sum() / whole["true_j"].sum() - 1.0
    assert abs(err) < 0.025, (err, len(whole), m)


@pytest.fixture(scope="module")
def sglang_outcome(runs):
    o = runs["sglang_outcome"].result()
    return o, score_mixed(o)


def test_sglangs_native_generate_is_counted_streamed_whole_and_batched(sglang_outcome):
    # Before: /generate was uncounted "other" work: every such request no share (-100%), its energy on the chat beside
    # it (+34%). Then (this trace, two runs): generate -18%/-17%, whole -4%/+11%, batch (two prompts, n = 2) -5%/-9%,
    # chat -13%/-14%; all of them low by the ~11-14% of the requests' energy the ledger put in unproxied on this
    # flavour with no bypass traffic at all (SGLang's counter moves when a request ends, and its jumps passed for
    # bypass tokens). Compared with the proxied requests' tokens at their ends (docs/daemon.md, Bypass traffic):
    # generate +1.9%, whole -1.2%, batch +3.0%, chat -3.7%, unproxied 0 J (1973 J before, in the same run's pair).
    # With no bypass traffic here, any unproxied energy is the ledger's error: six runs alone beside a CPU hog put
    # 0.03-0.98% of the requests' energy there, a loaded full suite 1.36%; the bug read 11-14%.
    # Judged: the unproxied energy of intervals whose count the daemon calls `complete`, and the kinds' rows where
    # the host did not run the proxy late. On a loaded host the proxy's own lag behind the server reads as bypass tokens,
    # and those intervals say `proxy_lag` (their rows `bypass-uncounted`): beside 2 CPU hogs and other jobs (load 6-10
    # on 2 cores) 3.89% of the requests' energy in unproxied (CI saw 2.95% and 17%), 2.98% in such intervals, every
    # one saying so, 0.91% in `complete` ones (within the count's tolerance, a token plus 5% of a window's count).
    o, s = sglang_outcome
    assert abs(s["conservation_err"]) <= 0.001
    complete_j, flagged_j, unsaid = _unproxied_split(o)
    assert not len(unsaid), unsaid  # unproxied energy in an interval whose count may be off says so
    assert complete_j <= 0.02 * s["requests_true_j"], (complete_j, flagged_j, s["requests_true_j"])
    # The rest of the requests' energy is in those flagged intervals' unproxied: -3.8%, -3.4%, -6.7% alone, -0.8%,
    # -0.2%, +0.1% with it (in the runs above).
    assert s["requests_est_j"] + flagged_j == pytest.approx(s["requests_true_j"], rel=0.03), (s["requests_est_j"],
                                                                                               flagged_j)
    for kind in ("generate", "generate_whole", "generate_batch", "chat"):
        m = s["kinds_all"][kind]
        assert m["n"] >= 20 and m["no_share"] == 0, (kind, m)
        rows = o.requests[o.requests["kind"] == kind]
        assert not rows["energy_note"].dropna().str.contains("does not count").any()
        # Judged as the embeddings are (test_embeddings_get_the_energy_of_their_forward_pass): the rows read late
        # (READ_LATE) and split by the fixed ratio read far off (one run beside CPU hogs: chat's 22 rows not read
        # late of 125 -11.6%), as their notes say they may.
        err, bound, n = _sum_err(o, kind, 0.1, 0.3)
        assert abs(err) < bound, (kind, err, bound, n, m)
    assert not any(n.startswith("uncounted") for n in s["notes"]), s["notes"]
    for kind in ("generate", "generate_whole", "generate_batch"):
        g = o.requests[(o.requests["kind"] == kind) & o.requests["true_tokens"].notna()]
        assert (g["api"] == "sglang-generate").all() and (g["prompt_tokens"] > 0).all()
        assert (g["generated_tokens"] == g["true_tokens"]).all(), g[["generated_tokens", "true_tokens"]]


@pytest.fixture(scope="module")
def sglang_n2(runs):
    return runs["sglang_n2"].result()


def test_sglang_n2_prompts_prefilled_apart_are_costed_whole_and_a_hit_it_never_says_is_flagged(sglang_n2):
    # SGLang prefills an n > 1 request's prompt in a request of its own (max_new_tokens 0) before its n sequences,
    # which all say the prompt but one token cached (tokenizer_manager._handle_batch_request). Before: the prompt's
    # prefill was costed at 1 token, its energy given to the requests beside it, unsaid (this trace: n = 2 /generate
    # -44%, n = 1 /generate beside it +30%, n = 2 chat +22%); now within 1% each (one run: +0.7%, -0.8%, +0.6%).
    o = sglang_n2
    s = score_mixed(o)
    assert abs(s["conservation_err"]) <= 0.001
    notes = o.requests["energy_note"].fillna("")
    own = notes.str.contains("cached prompt token.s. in the scrape window.s. over its prefill")
    for kind in ("generate", "generate_n2", "chat_n2"):
        m = s["kinds_all"][kind]
        assert m["n"] >= 15 and m["no_share"] == 0 and abs(m["sum_err"]) < 0.1, (kind, m)
        # Every choice's hit is known (said or not: SGLang's chat says none here): a hit unsaid is only the `_again`
        # requests' (a request prefilled apart in its scrape window may have been the one, and says so: not most).
        assert own[o.requests["kind"] == kind].mean() < 0.5, kind
    assert not own[o.requests["kind"] == "generate"].any()  # its answer says its cached count: never the one
    # One prompt every time: the prefill SGLang runs apart finds it cached from the time before, and says so nowhere
    # but on /metrics: the request is costed at its whole prompt, and its row says that this may be too high.
    again = o.requests[o.requests["kind"] == "generate_n2_again"].sort_values("t_arrival_utc")
    said = again["energy_note"].fillna("")
    # Two runs: 14 of 19 say so of their own prefill, 17 of 19 say it of theirs or of one beside (the counter cannot
    # tell which of the requests prefilled apart in a scrape window reused what no answer said).
    assert said.iloc[1:].str.contains("prefilled apart by the server").mean() >= 0.5, said.tolist()
    # (13 of 19 once, in a fresh-clone run beside other tests: the share is timing-bound.)
    assert said.iloc[1:].str.contains("prefix-cache-unsaid").mean() >= 0.6, said.tolist()
