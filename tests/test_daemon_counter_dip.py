"""A server's token counter that dips for one scrape without a restart (a multi-process /metrics page summed while a
worker's share lags: SGLang's, a vLLM with several API servers) is not a restart: nothing made up, nothing left out;
a real restart (a start time moved, the counter fallen near 0, the server unreachable, a fall that stays) still is."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from powerprof.daemon.scrape import BLIP_RATE_MARGIN, Scraper


def _sglang(tokens: float) -> str:
    return f'# TYPE sglang:generation_tokens_total counter\nsglang:generation_tokens_total{{model_name="m"}} {tokens}\n'


def _vllm_multiprocess(tokens: float) -> str:
    # A vLLM with several API servers serves prometheus_client's multiprocess collector: no process_start_time_seconds.
    return f'# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{{model_name="m",engine="0"}} {tokens}\n'


DOWN = "down"  # this scrape finds nothing listening (connection refused): the server is down
UNRESOLVED = "unresolved"  # this scrape cannot connect for another reason (its host name does not resolve)
CONNECT_TIMEOUT = "connect-timeout"  # nor this one (the connect timed out: a host unreachable, a lost packet)


def _scrapes(kind: str, script: list, seen: list | None = None, n: int | None = None, period_s: float | None = None,
             monkeypatch=None) -> tuple[list, Scraper]:
    """The deltas of one Scraper reading the pages of `script` in turn (DOWN: a refused connection) over `n` scrapes
    (default: one a page); `seen` gets each scrape's (delta, cache_hits, finished). With `period_s`, the scraper's
    clock moves that much a scrape (the scrape interval), else the pages take (almost) no time."""
    if period_s is not None:
        import types

        from powerprof.daemon import scrape

        clock = [1000.0]
        monkeypatch.setattr(scrape, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0]))

    class Scripted(Scraper):
        async def _get(self, path):
            step = script.pop(0)
            if step == DOWN:  # a real refusal: a port nothing listens on
                import socket

                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                async with self.session.get(f"http://127.0.0.1:{port}/metrics"):
                    pass
            if step == UNRESOLVED:  # as aiohttp raises it: a ClientConnectorError whose os_error is the resolver's
                import socket

                raise aiohttp.ClientConnectorError(_KEY, socket.gaierror(-2, "Name or service not known"))
            if step == CONNECT_TIMEOUT:
                raise aiohttp.ClientConnectorError(_KEY, TimeoutError(110, "Connection timed out"))
            if step == "503":  # a loading server's, or a gateway's while its upstream is down
                return 503, ""
            return 200, step

    async def go():
        async with aiohttp.ClientSession() as s:
            sc = Scripted(s, "http://x", kind)
            out = []
            for _ in range(n or len(script)):
                out.append(await sc.scrape())
                if seen is not None:
                    seen.append((out[-1], sc.cache_hits, sc.finished))
                if period_s is not None:
                    clock[0] += period_s
            return out, sc

    return asyncio.run(asyncio.wait_for(go(), 60))


class _Key:  # what ClientConnectorError's message reads of its connection
    host, port, ssl = "server.example", 8000, None


_KEY = _Key()


@pytest.mark.parametrize("page", [_sglang, _vllm_multiprocess])
def test_a_counter_that_dips_for_one_scrape_is_neither_a_restart_nor_tokens(page):
    # Before: 1000 then 995 was read as a restart: the whole 995 counted as one window's tokens (bypass traffic that
    # never ran, its energy taken from the requests beside it), the window marked server_restart and left out.
    deltas, sc = _scrapes(page.__name__.lstrip("_").split("_")[0], [page(1000), page(995), page(1010), page(1030)])
    assert deltas == [0, None, 10, 20]  # the dipped page is not believed; counted from the highest reading again
    assert sc.total == 30 and sc.restarts == 0 and sc.dips == 1 and sc.errors == 0
    assert sc.partial == {} and sc.window_partial == ()


def test_a_counter_fallen_near_zero_is_a_restart_at_once():
    deltas, sc = _scrapes("sglang", [_sglang(1000), _sglang(40), _sglang(100)])
    assert deltas == [0, 40, 60] and sc.restarts == 1 and sc.dips == 0


def test_a_young_counter_that_dips_to_half_or_less_is_no_restart():
    # A loaded CI run: the simulated SGLang's first dip came before any request had finished, its counter the warm-up's
    # 2 tokens, shown 0 (4 below, floored): "fell to half or less" read it as a restart, the window marked
    # server_restart and the next page's 2 warm-up tokens counted again (1442 counted for 1440 generated). A dip of a
    # few tokens takes a counter that small to half or less, so there the fall is judged as any other: the next page
    # tells.
    deltas, sc = _scrapes("sglang", [_sglang(2), _sglang(0), _sglang(34), _sglang(66)])
    assert deltas == [0, None, 32, 32] and sc.total == 64 and sc.restarts == 0 and sc.dips == 1, (deltas, sc.restarts)
    assert sc.partial == {} and sc.window_partial == ()


def test_a_young_counter_fallen_by_more_than_a_dip_and_still_below_at_the_next_page_is_a_restart():
    # A restart while the counter is young, no scrape finding the server down: 40 to 0, then 2 at the next page, which
    # no dip gives (a dip adds nothing: its next page reads 40 or more). Before the young rule, taken for a second dip:
    # counted from the highest reading (40), the new process's 50 tokens counted as 10 (deltas [0, None, 0, 10], said
    # counter_below). A restart at the next page, every token of the new process counted from 0. (Read as a restart
    # at once, a real dip of that size counted its tokens twice: test_young_dip_of_ten_tokens_is_not_counted_twice.)
    deltas, sc = _scrapes("sglang", [_sglang(40), _sglang(0), _sglang(2), _sglang(50)])
    assert deltas == [0, None, 2, 48] and sc.restarts == 1 and "server_restart" in sc.partial, deltas
    assert "counter_below" not in sc.partial


def test_young_dip_of_ten_tokens_is_not_counted_twice():
    # A young counter's real dip of more than a few tokens: on SGLang's multi-process page one process's share lags, and
    # SGLang adds at a request's finish, so the lagging share is a whole request's tokens (10 here). Read as a restart at
    # once (a young fall of more than YOUNG_DIP_TOKENS), 10 of the 20 tokens were counted twice (deltas [0, 10, 10, 20]):
    # phantom bypass tokens. Held and judged at the next page, which is back at the highest reading: a dip, counted
    # from it; its window is marked (it could also be a restart whose new process passed the old reading already).
    seen = []
    deltas, sc = _scrapes("sglang", [_sglang(20), _sglang(10), _sglang(20), _sglang(40)], seen)
    assert sum(d or 0 for d in deltas) == 20 and deltas == [0, None, 0, 20] and sc.restarts == 0, (deltas, sc.restarts)
    assert "counter_below" in sc.partial and "server_restart" not in sc.partial


def test_a_young_counter_fallen_far_and_back_past_its_reading_is_counted_once_and_said():
    # The reviewer's worst case: 64 → 0 → 64. Before, a restart at once: 64 phantom tokens, and the window after it
    # (its count back at 64, where a restart's new process has counted 64 too) marked nothing.
    deltas, sc = _scrapes("sglang", [_sglang(64), _sglang(0), _sglang(64), _sglang(70)])
    assert deltas == [0, None, 0, 6] and sc.restarts == 0, deltas
    assert "counter_below" in sc.partial and "server_restart" not in sc.partial


def test_a_young_counter_still_fallen_at_the_next_page_is_counted_from_its_highest_reading_and_said():
    # A fall of a dip's size while young (4 to 0), still below at the next page: a restart or a second dip, not told
    # apart: counted from the highest reading (4), never a token made up, and the window said (counter_below).
    deltas, sc = _scrapes("sglang", [_sglang(4), _sglang(0), _sglang(2), _sglang(50)])
    assert deltas == [0, None, 0, 46] and sc.restarts == 0 and "counter_below" in sc.partial, deltas


def test_a_young_counter_the_server_was_down_before_is_still_a_restart_at_once():
    deltas, sc = _scrapes("sglang", [_sglang(2), DOWN, _sglang(0), _sglang(2)])
    assert deltas == [0, None, 0, 2] and sc.restarts == 1 and "server_restart" in sc.partial, deltas


@pytest.mark.parametrize("down", [DOWN, "503"])
def test_a_counter_past_its_reading_after_the_server_was_found_down_says_it_may_be_low(down):
    # A restart whose new process passed the old reading by the first page after it (a young counter, a fast server):
    # only total - old reading is counted, the new process's tokens up to the old reading are in no count. Before,
    # that window said nothing (`complete`): 40, down, 50 counted 10 where the new process had counted 50. Nothing on
    # a page without a start time tells it from a server found down and back with its counter whole (a gateway's
    # 503), so the count is kept (no token made up) and the window said, as a young counter's dip back at its reading.
    seen: list = []
    deltas, sc = _scrapes("sglang", [_sglang(40), down, _sglang(50), _sglang(60)], seen)
    assert deltas == [0, None, 10, 10] and sc.restarts == 0, deltas
    assert "counter_below" in sc.partial and "server_restart" not in sc.partial, sc.partial
    assert sc.window_partial == (), sc.window_partial  # the window after it is whole again


@pytest.mark.parametrize("down", [DOWN, "503"])
def test_a_counter_back_at_exactly_its_reading_after_the_server_was_found_down_is_said_unless_nothing_moved_behind_a_503(
        down):
    # The review's case: the old SGLang at 34 tokens (its warm-up's 2 and one 32-token request), restarted, the new one
    # at 34 by its first page (its warm-up's 2 and one 32-token bypass request): 32 ran, none counted, nothing said.
    # Its finished-request histogram tells the new process (its own requests' seconds) from the same one idle since.
    deltas, sc = _scrapes("sglang", [_sglang_full(34, 0, 2, 0.35), down, _sglang_full(34, 0, 2, 0.41),
                                     _sglang_full(34, 0, 2, 0.41)])
    assert deltas == [0, None, 0, 0] and "counter_below" in sc.partial, (deltas, sc.partial)
    # Its histogram as it was: behind a gateway's 503 the same process back idle, nothing said. Found down (refused:
    # nothing listened), a new process of the same counts as likely (the simulator's restart between 2 s scrapes: its
    # warm-up's 2 and nothing finished, read as idle, 2687 of 3072 bypass tokens counted, every row complete): said.
    deltas, sc = _scrapes("sglang", [_sglang_full(34, 0, 2, 0.35), down, _sglang_full(34, 0, 2, 0.35),
                                     _sglang_full(44, 0, 3, 0.5)])
    assert deltas == [0, None, 0, 10], deltas
    assert (sc.partial == {}) if down == "503" else ("counter_below" in sc.partial and sc.below == 1), sc.partial


def _llama_page(tokens: float, steps: float) -> str:
    return (f"# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total {tokens}\n"
            f"# TYPE llamacpp:n_decode_total counter\nllamacpp:n_decode_total {steps}\n")


def test_a_llama_server_back_past_its_reading_after_it_was_found_down_says_it_may_be_low():
    # The review's llama.cpp case: 40 tokens in 40 decode calls, a refused scrape, then 50 in 50: a new process that
    # passed both counters (two bypass requests at once take fewer calls than tokens) counted 10 of its 50, unsaid.
    # Back with neither counter moved after a refused scrape: a death all the same (a new process of the same counts, or
    # the old one idle): said, the count kept.
    import json

    def pages(script):
        out = []
        for step in script:
            out.append(step if step == DOWN else _llama_page(*step))
            if step != DOWN:  # each believed scrape reads /slots after /metrics
                out.append(json.dumps([{"id": 0, "id_task": 1, "is_processing": False,
                                        "next_token": [{"n_decoded": 0}]}]))
        return out

    deltas, sc = _scrapes("llamacpp", pages([(40, 40), DOWN, (50, 50), (60, 60)]), n=4)
    assert deltas == [0, None, 10, 10] and sc.errors == 1, deltas
    assert "counter_below" in sc.partial and sc.restarts == 0, (deltas, sc.partial)
    deltas, sc = _scrapes("llamacpp", pages([(40, 40), DOWN, (40, 40), (50, 50)]), n=4)
    assert deltas == [0, None, 0, 10] and "counter_below" in sc.partial and sc.restarts == 0, (deltas, sc.partial)


@pytest.mark.parametrize("down", [DOWN, "503"])
def test_a_grown_counter_back_past_its_reading_after_a_short_outage_is_the_same_process_and_not_marked(down, monkeypatch):
    # A gateway answering 503 for a scrape in front of a server that has run for hours: no new process counts 5,000,000
    # tokens from zero in the 2 s since the last page believed (FASTEST_SERVER_TOKENS_PER_S), so it is the same process
    # and its window whole. Before, each such blip marked its window counter_below (a gateway's 503 now and then, one
    # marked window each time).
    deltas, sc = _scrapes("sglang", [_sglang(5e6), down, _sglang(5e6 + 40), _sglang(5e6 + 80)], period_s=1.0,
                          monkeypatch=monkeypatch)
    assert deltas == [0, None, 40, 40] and sc.partial == {} and sc.restarts == 0, (deltas, sc.partial)
    # The same on llama-server's page (its finished-token counter and decode calls), found down by a refusal.
    import json

    slots = json.dumps([{"id": 0, "id_task": 1, "is_processing": False, "next_token": [{"n_decoded": 0}]}])
    script = [_llama_page(5e6, 5e6), slots, DOWN, _llama_page(5e6 + 40, 5e6 + 40), slots,
              _llama_page(5e6 + 80, 5e6 + 80), slots]
    deltas, sc = _scrapes("llamacpp", script, n=4, period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, None, 40, 40] and sc.partial == {} and sc.restarts == 0, (deltas, sc.partial)


def test_a_grown_counter_back_past_its_reading_after_a_long_outage_is_still_said(monkeypatch):
    # Down for minutes, a new process may have counted past 5,000,000 by its first page: not told apart, said as before.
    deltas, sc = _scrapes("sglang", [_sglang(5e6), DOWN, _sglang(5e6 + 40), _sglang(5e6 + 80)], period_s=300.0,
                          monkeypatch=monkeypatch)
    assert deltas == [0, None, 40, 40] and "counter_below" in sc.partial, (deltas, sc.partial)


def test_a_counter_back_past_its_reading_on_a_page_with_an_unmoved_start_time_is_not_marked():
    # vLLM's page says its process's start time: the same one back, the server was not restarted, the count is whole.
    page = lambda n: _vllm_multiprocess(n) + "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1700000000.0\n"
    deltas, sc = _scrapes("vllm", [page(40), DOWN, page(50), page(60)])
    assert deltas == [0, None, 10, 10] and sc.partial == {}, (deltas, sc.partial)


def test_a_grown_counter_fallen_to_half_or_less_is_still_a_restart_at_once():
    deltas, sc = _scrapes("sglang", [_sglang(200), _sglang(100), _sglang(150)])
    assert deltas == [0, 100, 50] and sc.restarts == 1 and sc.dips == 0, deltas


def test_a_simulated_sglangs_first_dip_before_any_request_finished_is_no_restart():
    """The loaded CI failure, made certain: the simulated SGLang's page dips (4 tokens, floored at 0) while its counter
    is still its warm-up's 2 tokens; before, read as a restart (the window marked server_restart, 2 tokens counted
    twice)."""
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    async def go(srv):
        async with aiohttp.ClientSession() as s:
            sc = Scraper(s, srv.url, "sglang")
            srv.dip_counter(4, every=2)
            assert await sc.scrape() == 0  # the baseline: the warm-up's 2 tokens
            got = [await sc.scrape()]  # the second read dips: 0
            body = {"text": "x", "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
            async with s.post(srv.url + "/generate", json=body) as r:
                assert r.status == 200
                await r.read()
            got.append(await sc.scrape())
            return got, sc

    with SimServer(SimNVML("seed-16g", state_path=None), flavour="sglang", decode_tok_s=400.0, draft_n_max=0) as srv:
        got, sc = asyncio.run(asyncio.wait_for(go(srv), 60))
        assert [d[1] for d in srv.dips] == [0.0], srv.dips  # the plug did dip, to 0
    assert got == [None, 30] and sc.restarts == 0 and sc.dips == 1 and sc.partial == {}, (got, sc.partial)


def test_a_dip_the_server_was_down_before_is_a_restart_at_once():
    # A young server restarted under load may show a counter just below the old one; its scrape failed while it was
    # down (nothing listening): that is the evidence.
    deltas, sc = _scrapes("sglang", [_sglang(1000), DOWN, _sglang(990), _sglang(1000)])
    assert deltas == [0, None, 990, 10] and sc.restarts == 1 and sc.dips == 0
    assert "server_restart" in sc.partial


def test_two_dips_in_a_row_make_no_tokens_up_and_say_the_count_may_be_low():
    # Before: the fall still there at the next page (99995, itself a dip) was taken for a restart and the whole counter
    # counted: 99995 tokens in one window that the server never generated, marked server_restart, whose words said the
    # count "may be low". A fall above half, the server never found down, is no restart: counted from the highest
    # reading (0 here), the window marked counter_below, which says what it may have missed.
    deltas, sc = _scrapes("sglang", [_sglang(100000), _sglang(99990), _sglang(99995), _sglang(100010)])
    assert deltas == [0, None, 0, 10] and sc.total == 10 and sc.restarts == 0, (deltas, sc.total)
    assert "server_restart" not in sc.partial and "counter_below" in sc.partial
    assert "not a restart" not in sc.partial["counter_below"] and "exact" in sc.partial["counter_below"]
    assert sc.window_partial == ()  # the page after, at its highest reading again, is whole


def test_a_fall_that_has_not_come_back_at_the_next_scrape_is_counted_from_the_highest_reading_and_said():
    # A restart whose new counter is above half the old reading (998 of 1000) cannot be told from two dips: counted from
    # the highest reading, never a token made up; each window while the counter stays below it is marked counter_below.
    script = [_sglang(1000), _sglang(995), _sglang(998), _sglang(999), _sglang(1005)]
    deltas, sc = _scrapes("sglang", script)
    assert deltas == [0, None, 0, 0, 5] and sc.total == 5 and sc.restarts == 0, deltas
    assert "counter_below" in sc.partial and "restart" in sc.partial["counter_below"]


def test_the_window_while_a_counter_stays_below_its_highest_reading_is_marked():
    deltas, sc = _scrapes("sglang", [_sglang(1000), _sglang(995), _sglang(998)])
    assert deltas == [0, None, 0] and sc.window_partial == ("counter_below",)
    # A fall to half or less after it is still a restart at once.
    deltas, sc = _scrapes("sglang", [_sglang(1000), _sglang(995), _sglang(998), _sglang(300), _sglang(350)])
    assert deltas == [0, None, 0, 300, 50] and sc.restarts == 1 and "server_restart" in sc.partial


def _sglang_full(tokens: float, hits: float, finished: int, seconds: float) -> str:
    # Its token counter with the prefix-cache hit counter and the end-to-end latency histogram the ledger checks
    # hits against and spreads an at-finish window's bypass tokens back with.
    lat = "sglang:e2e_request_latency_seconds"
    return (_sglang(tokens) + f'# TYPE sglang:cached_tokens_total counter\nsglang:cached_tokens_total{{model_name="m"}} {hits}\n'
            f'# TYPE {lat} histogram\n{lat}_bucket{{le="+Inf",model_name="m"}} {finished}\n'
            f'{lat}_count{{model_name="m"}} {finished}\n{lat}_sum{{model_name="m"}} {seconds}\n')


def test_the_window_after_a_counter_below_run_says_only_its_own_hits_and_finished_requests():
    # The windows while the counter stays below its highest reading close (0 tokens, marked counter_below), but their
    # hits and finished requests were left in the base: the first window after them said all of them as its own, unmarked
    # (here 130 hits and 5 requests where it counted 30 and 1): its requests' said counts found no room (prefix-cache-
    # unsaid, every answer having said its count) and an at-finish window's bypass requests were spread back over 4
    # requests' durations that ended in the windows before. A figure of its own or none (unknown), never theirs.
    script = [_sglang_full(1000, 100, 10, 20.0), _sglang_full(990, 150, 12, 24.0), _sglang_full(995, 200, 14, 28.0),
              _sglang_full(1010, 230, 15, 30.0)]

    seen: list = []
    deltas, _sc = _scrapes("sglang", script, seen)
    assert deltas == [0, None, 0, 10], deltas
    _d, hits, finished = seen[-1]
    assert hits in (None, 30.0), seen
    assert finished in (None, (1.0, 2.0)), seen


def test_a_dip_on_a_page_with_a_start_time_is_still_refused_as_before():
    page = ("process_start_time_seconds 1700000000.0\n# TYPE vllm:generation_tokens_total counter\n"
            'vllm:generation_tokens_total{model_name="m"} %s\n')
    deltas, sc = _scrapes("vllm", [page % 1000, page % 995, page % 1010])
    assert deltas == [0, None, 10] and sc.restarts == 0 and sc.errors == 1


# --- the daemon beside a simulated SGLang whose counter dips: its figures against the simulator's truth -------------


def dip_run(tmp_path, dip_tokens: int, every: int = 3, run_s: float = 5.0) -> dict:
    """A daemon in front of a simulated SGLang (continuous batching) whose /metrics counter dips `dip_tokens` below the
    page before at every `every`-th read (SimServer.dip_counter), 2 proxied lanes and 1 bypass lane of 32-token
    streams for `run_s`; the dip is turned off at the end, so the stop's final scrape reads the truth. Returns the
    figures against the simulator's truth."""
    import itertools
    import time

    from daemon_helpers import read_dataset
    from powerprof.daemon.config import load_config
    from powerprof.daemon.service import Daemon
    from powerprof.rig import Rig
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    nvml = SimNVML("a100-40g", state_path=None)
    srv = SimServer(nvml, flavour="sglang", n_slots=8, batching="continuous", decode_tok_s=200.0, draft_n_max=0).start()
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 0.25, "daemon.flush_interval_s": 0.5,
        "proxy.listen": "127.0.0.1:0", "proxy.upstream": srv.url, "metrics.listen": "",
        "daemon.restore_on_start": False, "tags.socket": str(tmp_path / "pp.sock"), "scrape.server": "sglang"})
    daemon = Daemon(cfg, Rig("a100-40g", nvml=nvml, host=False))
    ids = itertools.count()
    bypass: set[str] = set()

    async def stream(s, url, rid):
        body = {"model": "m", "prompt": "x " * 20, "max_tokens": 32, "ignore_eos": True, "stream": True}
        async with s.post(url + "/v1/completions", json=body, headers={"X-Sim-Request-Id": rid}) as r:
            assert r.status == 200
            await r.read()

    async def go():
        task = asyncio.create_task(daemon.run())
        while "proxy" not in daemon.urls:
            assert not task.done(), "the daemon ended before it listened"
            await asyncio.sleep(0.05)
        srv.dip_counter(dip_tokens, every)
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s:
            async def lane(url, is_bypass):
                while time.monotonic() - t0 < run_s:
                    rid = str(next(ids))
                    if is_bypass:
                        bypass.add(rid)
                    await stream(s, url, rid)
                    await asyncio.sleep(0.1)  # idle gaps: SGLang's counter still, where a dip shows as a fall

            await asyncio.gather(lane(daemon.urls["proxy"], False), lane(daemon.urls["proxy"], False), lane(srv.url, True))
        srv.dip_counter(0)
        await asyncio.sleep(1.0)
        daemon.stop_event.set()
        await task

    try:
        asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        srv.stop()
    rows = read_dataset(tmp_path / "data", "intervals").to_dict("records")
    true_tokens = sum(r["generated"] for r in srv.truth)
    true_bypass = sum(r["generated"] for r in srv.truth if r["client_id"] in bypass)
    scraped = [r for r in rows if r["server_tokens"] is not None and r["server_tokens"] == r["server_tokens"]]
    return {
        "dips": len(srv.dips),
        "restarts_told": daemon.scraper.restarts,
        "rows_server_restart": sum("server_restart" in (r["server_count"] or "") for r in rows),
        "rows": len(rows),
        "server_tokens_counted": daemon.scraper.total,
        "server_tokens_true": true_tokens,
        "bypass_tokens_stored": sum(r["server_tokens"] for r in scraped),  # a row's: those beyond the proxy's
        "bypass_tokens_true": true_bypass,
        "jpt_left_out": dict(daemon.ledger.totals.jpt_left_out),
    }


def test_a_dipping_sglang_counter_leaves_no_window_out_and_makes_no_tokens_up(tmp_path):
    """Before: every dip read as a restart (6 of 6 in a 5 s run), 49 of 61 interval rows marked server_restart, 27
    intervals left out of J/token, and each dip made the whole counter into one window's tokens: 5964 counted for 1632
    generated, 4908 bypass tokens stored for 544 run. Now exact, as without dips."""
    got = dip_run(tmp_path, dip_tokens=4)
    assert got["dips"] >= 3, got  # the plug did dip (every third read)
    assert got["restarts_told"] == 0 and got["rows_server_restart"] == 0, got
    assert not any("restart" in k or "bypass" in k for k in got["jpt_left_out"]), got
    # The server's own count is exact: nothing counted twice, nothing lost.
    assert got["server_tokens_counted"] == got["server_tokens_true"], got
    # Bypass tokens as the rows store them (`server_tokens`: those the server counted beyond the proxy's).
    assert abs(got["bypass_tokens_stored"] - got["bypass_tokens_true"]) <= 0.25 * got["bypass_tokens_true"] + 32, got


@pytest.mark.parametrize("after", [40, 50])
def test_a_simulated_sglang_restart_is_still_told_while_its_dips_are_not(after):
    """Against the simulator's SGLang: dips every other read are not believed; a real restart (down 0.3 s, its counter
    from the warm-up's 2 tokens again) whose counter is at half the old one or less at the first page after it is a
    restart, and the count after it is the new process's, exact; above half, it is said (counter_below)."""
    import time

    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    async def go(srv):
        async with aiohttp.ClientSession() as s:
            sc = Scraper(s, srv.url, "sglang")
            assert await sc.scrape() == 0  # the baseline
            body = {"text": "x", "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}
            for _ in range(2):
                async with s.post(srv.url + "/generate", json=body) as r:
                    assert r.status == 200
                    await r.read()
            srv.dip_counter(3, every=2)
            got = [await sc.scrape() for _ in range(4)]  # read 2 and 4 dip
            assert got == [100, None, 0, None] and sc.restarts == 0 and sc.dips == 2, got
            srv.dip_counter(0)
            await asyncio.wrap_future(srv.restart(0.3))
            body["sampling_params"]["max_new_tokens"] = after
            async with s.post(srv.url + "/generate", json=body) as r:
                await r.read()
            deadline = time.monotonic() + 30
            while (delta := await sc.scrape()) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return delta, sc

    with SimServer(SimNVML("seed-16g", state_path=None), flavour="sglang", decode_tok_s=400.0, draft_n_max=0) as srv:
        delta, sc = asyncio.run(asyncio.wait_for(go(srv), 60))
    if after == 40:
        assert sc.restarts == 1 and "server_restart" in sc.window_partial
        assert delta == 42  # the new process's warm-up (2) and the request after it (40), counted from 0
    else:
        # 52 of the old 102, a dip (99) still pending, the server never found down: a restart or a second dip, not told
        # apart. Before, taken for a restart (52, right here; 99995 phantom tokens where it was a second dip); now
        # nothing made up: counted from 102, the window marked counter_below, whose words say what it may miss.
        assert sc.restarts == 0 and delta == 0 and sc.window_partial == ("counter_below",), (delta, sc.window_partial)


@pytest.mark.parametrize("failure", [UNRESOLVED, CONNECT_TIMEOUT])
def test_a_scrape_that_could_not_connect_for_another_reason_than_a_refusal_is_no_sign_of_a_restart(failure):
    # A server given by host name whose name did not resolve for one scrape (a DNS blip), or whose connect timed out, is
    # not shown down: only a refused connection (nothing listening) is. Before, any ClientConnectorError was, and the
    # dip on the next page (1000 then 990) was taken for a restart: 990 tokens counted in one window that the server
    # never generated, marked server_restart. Now the scrape is said as failed (could not read) and the dip is a dip.
    deltas, sc = _scrapes("sglang", [_sglang(1000), failure, _sglang(990), _sglang(1010)])
    assert deltas == [0, None, None, 10] and sc.restarts == 0 and sc.dips == 1, (deltas, sc.restarts)
    assert sc.errors == 1 and "server_restart" not in sc.partial


# --- a restart judged from a fall alone: the windows until the counter passes the reading before it are marked --------


def _run(pages_tok: list, period_s: float | None = None, monkeypatch=None) -> list:
    """(delta, window_partial) of each scrape of an SGLang page reading `pages_tok` tokens in turn; with `period_s`,
    the scraper's clock moves that much a scrape (the scrape interval), else the pages take no time."""
    if period_s is not None:
        import types

        from powerprof.daemon import scrape

        clock = [1000.0]
        monkeypatch.setattr(scrape, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0]))
    pages = [_sglang(x) for x in pages_tok]

    class S(Scraper):
        async def _get(self, path):
            return 200, pages.pop(0)

    async def go():
        async with aiohttp.ClientSession() as s:
            sc = S(s, "http://x", "sglang")
            out = []
            for _ in range(len(pages_tok)):
                out.append((await sc.scrape(), sc.window_partial))
                if period_s is not None:
                    clock[0] += period_s
            return out

    return asyncio.run(asyncio.wait_for(go(), 60))


def test_daemon_dip_of_one_requests_share_above_young_is_counted_twice_unmarked():
    # One process's share of a multi-process page lagging: 200, 400, 200 (half: a restart by the fall alone), 400, 440.
    # Before: deltas [0, 200, 200, 200, 40], only the third window marked: 640 counted where 240 ran, the fourth
    # window's 200 phantom tokens unmarked (booked as bypass in a `complete` row). Nothing tells this dip from a restart
    # whose new process counted 200 then 400, so the count is kept and every window until the counter is back at the
    # reading before the fall (400) says so: the restart's own window server_restart, the next fall_unconfirmed (may be
    # low or high; never server_restart, which the ledger takes for a restart in that window).
    got = _run([200, 400, 200, 400, 440])
    assert [d for d, _ in got] == [0, 200, 200, 200, 40], got
    assert [("server_restart" in w) for _, w in got] == [False, False, True, False, False], got
    assert [("fall_unconfirmed" in w) for _, w in got] == [False, False, False, True, False], got


def test_daemon_half_dip_second_window_is_unmarked():
    got = _run([200, 400, 200, 400, 440])
    assert not (got[3][0] == 200 and got[3][1] == ()), got


def test_daemon_young_dip_lasting_two_pages():
    # A young fall (20 → 10) still there at the next page is a restart (counted from 0: 10); a dip lasting two pages
    # reads the same. Before, the window after it (10 → 20) counted its 10 tokens unmarked: 20 counted where none ran.
    got = _run([20, 10, 10, 20, 20])
    assert all(not d or w for d, w in got), got
    assert "fall_unconfirmed" in got[3][1] and "server_restart" not in got[3][1], got
    assert got[-1] == (0, ()), got  # back at the reading before the fall: whole again


def test_a_restart_told_by_a_refused_connection_marks_only_its_own_window():
    # Real evidence (the server found down): the windows after it are the new process's, counted whole, unmarked.
    seen: list = []
    deltas, sc = _scrapes("sglang", [_sglang(1000), DOWN, _sglang(40), _sglang(100)], seen)
    assert deltas == [0, None, 40, 60] and sc.window_partial == (), (deltas, sc.window_partial)


def test_a_grown_counter_restarted_by_fall_alone_marks_a_bounded_number_of_windows(monkeypatch):
    # SGLang at 1,000,000 tokens restarting unseen: before, 201 of 202 windows said server_restart (about 17 min at
    # 1000 tokens/s; an idle server never passes the old reading). A dip lasts a scrape or two: after
    # FALL_UNCONFIRMED_PAGES scrapes and FALL_UNCONFIRMED_S the fall was a restart, the windows whole again (the
    # scripted pages take no time: the seconds' bound is set to 0 here, the pages' tested).
    from powerprof.daemon import scrape
    from powerprof.daemon.scrape import FALL_UNCONFIRMED_PAGES

    monkeypatch.setattr(scrape, "FALL_UNCONFIRMED_S", 0.0)

    pages = [1_000_000, 1000] + [1000 + 1000 * i for i in range(1, 201)]
    got = _run(pages)
    marked = [bool(w) for _, w in got]
    assert sum(marked) <= FALL_UNCONFIRMED_PAGES + 1 and sum(marked) < 60, got
    assert marked[1] and "server_restart" in got[1][1]  # the restart's own window
    assert all("server_restart" not in w for _, w in got[2:]), got
    assert all("fall_unconfirmed" in w for _, w in got[2:2 + FALL_UNCONFIRMED_PAGES]), got
    assert not any(marked[2 + FALL_UNCONFIRMED_PAGES:]), got
    assert [d for d, _ in got[2:]] == [1000] * 200  # the count itself unchanged


def test_a_connect_timeout_restart_by_fall_alone_marks_a_bounded_number_of_windows(monkeypatch):
    # Connect timeouts (a pod moved) are no sign of a restart: the fall alone tells it, and its marking is bounded too.
    from powerprof.daemon import scrape
    from powerprof.daemon.scrape import FALL_UNCONFIRMED_PAGES

    monkeypatch.setattr(scrape, "FALL_UNCONFIRMED_S", 0.0)

    script = [_sglang(50_000)] + [CONNECT_TIMEOUT] * 5 + [_sglang(100 + 100 * i) for i in range(50)]
    deltas, sc = _scrapes("sglang", script)
    assert sc.restarts == 1
    assert sc.window_partial == ()  # long past the bound: whole again


@pytest.mark.parametrize("pages,period_s", [
    ([200, 400, 200, 200, 200, 400, 440], 5.0),           # a 3-page dip at a 5 s scrape interval (the seconds' bound alone: 2 pages)
    ([200, 400] + [200] * 11 + [400, 440], 0.25),         # an 11-page dip at 0.25 s (the pages' bound alone: 2.5 s)
    ([200, 400, 200, 300, 150, 300, 400, 440], 0.25),     # a second fall while the first is unconfirmed
])
def test_a_dip_that_lasts_has_its_recovery_marked_within_the_bound(pages, period_s, monkeypatch):
    """The window where a dip that lasted recovers holds tokens counted again: it is marked (not `complete`), whichever
    of the bound's seconds and pages ends later, and a second fall keeps the first's higher reading."""
    got = _run(pages, period_s, monkeypatch)
    unmarked = [(i, d, w) for i, (d, w) in enumerate(got) if 3 <= i < len(got) - 1 and d and not w]
    assert not unmarked, got


@pytest.mark.parametrize("pages", [
    [200, 400] + [200] * 15 + [400, 440],                   # a flat dip: 75 s and 15 pages at 5 s scrapes
    [2000, 4000] + [2000 + 50 * i for i in range(15)] + [4800, 4850],  # the other shares go on: 50 a page, then +1000
])
def test_a_dip_that_lasts_past_the_bound_has_its_recovery_marked(pages, monkeypatch):
    # Past FALL_UNCONFIRMED_S and _PAGES the fall is taken for a restart, its windows whole again; a dip that lasted that
    # long and then came back had its recovery counted again, in an unmarked window (200 phantom tokens of 240, booked
    # as bypass in a `complete` row). The window that passes the reading before the fall in one jump (over twice the
    # largest rise since) says fall_unconfirmed; the count is kept.
    got = _run(pages, 5.0, monkeypatch)
    back = next(i for i, p in enumerate(pages) if i > 2 and p >= pages[1])
    assert "fall_unconfirmed" in got[back][1], (back, got)
    assert not got[back - 1][1] and not got[back + 1][1], got  # the bound's end still holds: whole around it
    assert got[back][0] == pages[back] - pages[back - 1], got


def test_a_restarted_counter_passing_its_old_reading_at_its_pace_is_not_marked(monkeypatch):
    # A restart by the fall alone, its new process counting 500 a page past the old reading (5000): no jump, whole.
    pages = [5000, 500] + [500 + 500 * i for i in range(1, 16)]
    got = _run(pages, 5.0, monkeypatch)
    assert not any(w for _, w in got[14:]), got
    assert [d for d, _ in got[2:]] == [500] * 15, got


def _answer(step, path):
    """A scripted step's answer to a GET: DOWN a refused connection, CONNECT_TIMEOUT a timed-out connect, "503" a
    loading page's 503, else the page itself."""
    if step == DOWN:
        raise aiohttp.ClientConnectorError(_KEY, ConnectionRefusedError(111, "Connection refused"))
    if step == CONNECT_TIMEOUT:
        raise aiohttp.ClientConnectorError(_KEY, TimeoutError(110, "Connection timed out"))
    if step == "503":
        return 503, "loading"
    return 200, step


def _scrape_steps(kind: str, steps: list, record, answer=_answer, monkeypatch=None) -> Scraper:
    """A Scraper of `kind` scraping once a step of `steps`, each GET of that scrape answered `answer(step, path)`;
    `record(sc)` after each scrape. With `monkeypatch`, the scraper's clock starts at 1 s and moves 0.25 s a scrape (in
    whole nanoseconds), else it is the real one. Returns the Scraper."""
    if monkeypatch is not None:
        import types

        from powerprof.daemon import scrape

        clock = [1_000_000_000]
        monkeypatch.setattr(scrape, "time", types.SimpleNamespace(monotonic=lambda: clock[0] / 1e9,
                                                                  monotonic_ns=lambda: clock[0],
                                                                  time=lambda: clock[0] / 1e9))

    async def go():
        async with aiohttp.ClientSession() as s:
            sc = Scraper(s, "http://x", kind)
            for step in steps:
                async def _get(path, step=step):
                    return answer(step, path)

                sc._get = _get
                await sc.scrape()
                record(sc)
                if monkeypatch is not None:
                    clock[0] += 250_000_000
            return sc

    return asyncio.run(asyncio.wait_for(go(), 60))


def test_a_restart_told_by_the_fall_alone_is_said_so_to_the_ledger_and_one_found_down_is_not():
    # The ledger ends the run-ons of a process that died at a restart (`Ledger._end_run_ons_at_restart`), not at one a
    # multi-process page's dip may have made (`Scraper.restart_by_fall`): a fall to half with the server never found
    # down is such; one after a scrape found it down, or a page whose start time moved, is a restart.
    for script, want in (([_sglang(1000), _sglang(400), _sglang(450)], [False, True, False]),
                         ([_sglang(1000), DOWN, _sglang(400), _sglang(450)], [False, False, False, False])):
        got: list = []
        sc = _scrape_steps("sglang", script, lambda sc: got.append(sc.restart_by_fall))
        assert sc.restarts == 1 and got == want, (script, got)
    # After a gateway's 503 a fall with a finished count gone back (10 → 6) is a restart whose window a scrape found
    # down (window_down_ns): the ledger is told as before a9b9bfd2 (it cuts a run-on there only with a death's proof),
    # while the window after says fall_unconfirmed (a multi-process page's lag reads so too).
    got, marks = [], []
    gateway = lambda step, path: (503, "<h1>503 Service Temporarily Unavailable</h1>") if step == "gw" else _answer(step, path)
    sc = _scrape_steps("sglang", [_page("sglang", 1000, 10), "gw", _page("sglang", 600, 6), _page("sglang", 640, 7)],
                       lambda sc: (got.append(sc.restart_by_fall), marks.append(sc.window_partial)), answer=gateway)
    assert sc.restarts == 1 and got == [False] * 4, got
    assert marks[2] == ("server_restart",) and marks[3] == ("fall_unconfirmed",), marks


def test_the_window_of_a_restart_says_when_its_first_scrape_found_the_server_down(monkeypatch):
    # The ledger places a dead process's run-ons' end between its last scrape and the first scrape that found the server
    # down (`Ledger._run_on_cut_ns`): the believed page after says when that scrape began (Scraper.window_down_ns), the
    # first of two down, and no window without one says any (a timeout is no death).
    pages = [_sglang(1000), _sglang(1010), DOWN, DOWN, _sglang(40), _sglang(50), CONNECT_TIMEOUT, _sglang(60)]
    got = []
    _scrape_steps("sglang", pages, lambda sc: got.append((sc.window_down_ns, sc.window_partial)),
                  monkeypatch=monkeypatch)
    assert [d for d, _ in got] == [None, None, None, None, 1_500_000_000, None, None, None], got
    assert "server_restart" in got[4][1], got


def test_the_window_of_a_restart_says_whether_its_first_down_scrape_was_refused(monkeypatch):
    # A refused connection (nothing listening) proves a death; a 503 (a router's, a loading page's) does not
    # (`Ledger._death_proven`): taken for one, a run-on the live server went on with was cut to 0.6 tokens and 2.5 J for
    # the truth's 160 and 400. The believed page after says which the window's first down scrape was.
    pages = [_sglang(1000), _sglang(1010), "503", DOWN, _sglang(40), _sglang(50), DOWN, "503", _sglang(10), _sglang(20)]
    got = []
    opened = []

    def record(sc):
        got.append((sc.window_down_ns, sc.window_down_refused))
        opened.append(sc.down_open())

    _scrape_steps("sglang", pages, record, monkeypatch=monkeypatch)
    assert [r for d, r in got if d is not None] == [False, True], got
    assert not any(r for d, r in got if d is None), got
    # Before the believed page, a found-down scrape opens the death's window at once (Scraper.down_open, Ledger.note_down):
    # from the first found-down scrape (the 503's, at 1.5 s) and the first refused (1.75 s). A 503 alone opens none
    # but llama-server's "Loading model" (below): a router's 503 blip, no restart after, opened one and a request the
    # router held and closed unanswered (never run) was costed 119 J.
    at = [1_000_000_000 + k * 250_000_000 for k in range(10)]
    assert opened == [None, None, None, (at[2], at[3]), None, None, (at[6], at[6]), (at[6], at[6]), None,
                      None], opened


def test_a_reloading_llamacpp_answering_503_loading_model_is_found_down(monkeypatch):
    # llama-server binds its port at once as it restarts and answers /metrics and /slots 503 "Loading model" while it
    # loads (tools/server/server.cpp). Both unread, the scrape said "answers neither /metrics (start it with
    # --metrics) nor /slots", a ValueError, not down: no window opened, and the whole answers the dead process closed
    # were written 0 J each (about 220 J of truth) before the new process's first page. Found down by the 503 now,
    # from that scrape (Scraper.down_open: nothing refused), and the new process's page closes a restart window.
    loading = '{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
    page = "# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total {}\n"
    steps = [page.format(100), page.format(120), loading, loading, page.format(5)]
    got = []
    errors = []

    def answer(step, path):
        if path == "/slots":
            return (503, loading) if step == loading else (501, "no slots")
        return (503, step) if step == loading else (200, step)

    def record(sc):
        got.append((sc.down_open(), sc.window_down_ns, "server_restart" in sc.window_partial))
        errors.append(sc.last_error)

    _scrape_steps("llamacpp", steps, record, answer, monkeypatch)
    at = [1_000_000_000 + k * 250_000_000 for k in range(5)]
    assert [g[0] for g in got] == [None, None, (at[2], None), (at[2], None), None], got
    assert got[4][1:] == (at[2], True), got
    # Its last_error in plain words users read (status, log): before, the private class name, "_MetricsStatus: /metrics
    # answered 503", and not what the 503 was.
    assert errors[2] == ('MetricsStatus: GET http://x/metrics answered 503 "Loading model": llama-server is loading '
                         'its model (a restart, most likely); scrapes go on until it answers'), errors


@pytest.mark.parametrize("kind", ["llamacpp", "vllm"])
def test_a_503_blip_that_is_not_llamacpp_loading_opens_no_crash_window(monkeypatch, kind):
    # A router, nginx's limit_req or an auth proxy answers /metrics (and /slots) 503 for a scrape or two in front of a
    # live server, with no restart after. Read as found down, it opened a crash's window at once (Scraper.down_open),
    # for vLLM too, and a request the router held and closed unanswered was costed 119 J (truth 0); on llama.cpp the
    # window back was marked counter_below with a restart warning. Only llama-server's own 503 "Loading model" opens
    # one; llama.cpp's blip is a failed scrape, its page back held to the server's pace as vLLM's (a server that has
    # counted 100000 tokens at 80 a second: the same process, whole).
    blip = "<html><body><h1>503 Service Temporarily Unavailable</h1></body></html>"
    page = ("# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total {}\n" if kind == "llamacpp"
            else "# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total {}\n")
    steps = [page.format(100000), page.format(100020), blip, blip, page.format(100040), page.format(100060)]
    got = []

    def answer(step, path):
        if path == "/slots":
            return (503, blip) if step == blip else (501, "no slots")
        return (503, step) if step == blip else (200, step)

    _scrape_steps(kind, steps, lambda sc: got.append((sc.down_open(), sc.window_partial, sc.last_error)), answer,
                  monkeypatch)
    assert [g[0] for g in got] == [None] * 6, got
    assert got[2][2].startswith("MetricsStatus: GET http://x/metrics answered 503" if kind == "vllm" else
                                "MetricsStatus: GET http://x/metrics answered 503 (not llama-server's"), got
    assert all(g[1] == () for g in got), got


def _llama_pages(script) -> list:
    """llama-server's GETs for `script`: a (tokens, decode calls) step is its /metrics then an idle /slots, "gw" a
    gateway's 503 to both."""
    import json

    out = []
    for step in script:
        if step == "gw":
            out += ["503", "503"]
        else:
            out += [_llama_page(*step), json.dumps([{"id": 0, "id_task": 1, "is_processing": False,
                                                     "next_token": [{"n_decoded": 0}]}])]
    return out


@pytest.mark.parametrize("kind,before,after,young,kept,reach", [
    # Past a new process's reach on llama.cpp: the same process (its counters cannot outlast a restart), no death.
    ("llamacpp", (50_000_000, 50_000_000), (50_000_400, 50_000_400), False, False, False),
    ("sglang", 50_000_000, 50_000_400, False, True, True),
    ("vllm", 50_000_000, 50_000_400, False, True, True),  # several API servers: no start time on the page
    ("sglang", 40, 50, True, True, False),  # a young server: a new process may have counted it (counter_below)
    ("llamacpp", (40, 40), (50, 50), True, True, False),
])
def test_a_page_back_past_a_new_processs_reach_after_a_refusal_keeps_its_refusal(kind, before, after, young, kept,
                                                                                   reach, monkeypatch):
    # A refused scrape, its page back past anything a new process could have counted since (FASTEST_SERVER_TOKENS_PER_S):
    # read whole (`_down_back`), the same process, or a restarted one whose counter persisted (SGLang or vLLM with a
    # never-wiped PROMETHEUS_MULTIPROC_DIR, restarted in place). Its refusal is kept, a death no page said a restart of:
    # cleared (batchfix8, the review's fault 2), a real death was lost, a whole answer's run-on costed 159.6 tokens and
    # 410 J for about 105 J, unflagged. The ledger cuts no batch span at it (`Ledger._batch_death`). A young server's
    # page is said counter_below too. llama.cpp's page past reach clears it: kept, a whole answer's run-on was cut at
    # a death that never happened (40.8 tokens and 103 J for 400 and 1001, unflagged).
    # SGLang's and vLLM's kept refusal says so (`window_past_reach`): that death is unsure, the ledger cuts no run-on
    # at it (`Ledger._run_on_cut_ns`); before, an SGLang whole answer's run-on was cut there unflagged (40.6 tokens and
    # 54 J for 159.6 and 271 where the same process lived on: tests/test_daemon_ledger.py).
    page = _vllm_multiprocess if kind == "vllm" else _sglang
    pages = ([_llama_pages([before]), [DOWN], _llama_pages([after])] if kind == "llamacpp"
             else [[page(before)], [DOWN], [page(after)]])
    deltas, sc = _scrapes(kind, [p for step in pages for p in step], n=3, period_s=1.0, monkeypatch=monkeypatch)
    got = (sc.window_down_ns is not None, sc.window_down_refused, "counter_below" in sc.window_partial,
           sc.window_past_reach)
    assert got == (True, kept, young, reach), (deltas, got)


@pytest.mark.parametrize("after,said", [(50_020_000, False), (80_000_000, True)], ids=["its_pace", "past_its_pace"])
def test_a_page_past_a_new_processs_reach_after_a_refusal_must_fit_the_servers_pace(after, said, monkeypatch):
    # SGLang at 10,000 tokens a second (49,990,000 then 50,000,000), a refused scrape, then a page at 80,000,000 two
    # seconds on: past a new process's reach, but no rise this server's pace allows (`_beyond_reach`): another process
    # on its port (another deployment's persisted counter). Read whole, as the same process back, its window counted
    # 30,000,000 tokens and said nothing (where a gateway's 503 said counter_below); now said, its refusal a sure
    # death (no `window_past_reach`). Back at its pace (20,000 in 2 s), the same process or its persisted counter, as
    # before.
    deltas, sc = _scrapes("sglang", [_sglang(49_990_000), _sglang(50_000_000), DOWN, _sglang(after)], n=4,
                          period_s=1.0, monkeypatch=monkeypatch)
    assert deltas[-1] == after - 50_000_000, deltas
    got = ("counter_below" in sc.window_partial, sc.window_past_reach, sc.window_down_refused)
    assert got == (said, not said, True), (deltas, got)


@pytest.mark.parametrize("idle,gap", [(0, DOWN), (5, DOWN), (5, "503"), (0, "503")],
                         ids=["first_page_refused", "idle_refused", "idle_503", "first_page_503"])
def test_a_page_past_reach_with_no_pace_known_may_rise_no_faster_than_any_server(idle, gap, monkeypatch):
    # SGLang at 50,000,000, its pace not known yet (the daemon's first page, or idle since), a refusal or a 503, then
    # 80,000,000 two seconds on: no one server counts 30,000,000 in 2 s (FASTEST_SERVER_TOKENS_PER_S), so another
    # process on its port. Before, read whole: delta 30,000,000, the window complete (`partial` empty; a review's
    # nopace.py); now counter_below. Within that bound (1,500,000 in 2 s) still read whole, the same process back.
    for after, said in ((80_000_000, True), (51_500_000, False)):
        deltas, sc = _scrapes("sglang", [_sglang(50_000_000)] * (idle + 1) + [gap, _sglang(after)], n=idle + 3,
                              period_s=1.0, monkeypatch=monkeypatch)
        assert deltas[-1] == after - 50_000_000, deltas
        assert ("counter_below" in sc.window_partial) == said, (after, deltas, sc.window_partial)


@pytest.mark.parametrize("script,said", [
    # A plain blip in front of a server that has run a while (10000 tokens, 40 a second): whole, as before.
    ([(9960, 9960), (10000, 10000), "gw", (10080, 10080), (10120, 10120)], False),
    # A young server (80 tokens) restarted behind a gateway's readiness lag, its new process at 100 by the page back:
    # within the 4 x 40 x 2 s a new process could have counted. Before: a plain failed scrape, 20 counted unsaid.
    ([(40, 40), (80, 80), "gw", (100, 100), (140, 140)], True),
    # A retry herd on the new process: 10500 tokens in 500 decode calls, past the old reading and the reach, but risen
    # 500 in 2 s where the server's pace allows 1.25 x 40 x 2 = 100. Before: 500 counted unsaid.
    ([(9960, 9960), (10000, 10000), "gw", (10500, 10500), (10540, 10540)], True),
    # Its tokens within the pace but its decode calls risen past theirs (a new process at another batch): said.
    ([(9960, 9960), (10000, 10000), "gw", (10080, 10400), (10120, 10440)], True),
])
def test_a_llamacpp_page_back_after_a_gateways_503_is_held_to_the_servers_pace(script, said, monkeypatch):
    deltas, sc = _scrapes("llamacpp", _llama_pages(script), n=len(script), period_s=1.0, monkeypatch=monkeypatch)
    first = script[0][0]
    want = [0, script[1][0] - first, None, script[3][0] - script[1][0], script[4][0] - script[3][0]]
    assert deltas == want and sc.restarts == 0 and sc.errors == 1, (deltas, sc.partial)
    assert ("counter_below" in sc.partial) == said and sc.below == int(said), (sc.partial, sc.below)


def test_a_gateways_503_on_metrics_with_slots_answered_is_a_failed_scrape_not_a_server_without_metrics(monkeypatch):
    # A gateway answers /metrics 503 for a scrape while /slots goes through: read as a llama-server without --metrics,
    # its window said slots_only (and the process-wide reason: "start llama-server with --metrics", of a server started
    # with it), and at the second such blip counted the slots' progress (20 decoded), which the page back counted again
    # from the highest reading: 100 counted for 80, 20 phantom bypass tokens. A 502/503 on /metrics is a failed scrape
    # (a blip, held to the server's pace when it is back), never "no metrics": exact.
    import json

    def busy(task):
        return json.dumps([{"id": 0, "id_task": task, "is_processing": True, "next_token": [{"n_decoded": 20}]}])

    script = (_llama_pages([(9960, 9960), (10000, 10000)]) + ["503", busy(7)] + _llama_pages([(10040, 10040)])
              + ["503", busy(8)] + _llama_pages([(10080, 10080)]))
    deltas, sc = _scrapes("llamacpp", script, n=6, period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, 40, None, 40, None, 40] and sc.errors == 2, (deltas, sc.partial)
    assert "slots_only" not in sc.partial and sc.partial == {}, sc.partial


def test_a_llamacpp_fall_after_a_gateways_503_is_still_a_restart(monkeypatch):
    deltas, sc = _scrapes("llamacpp", _llama_pages([(9960, 9960), (10000, 10000), "gw", (30, 30), (70, 70)]), n=5,
                          period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, 40, None, 30, 40] and sc.restarts == 1 and "server_restart" in sc.partial, (deltas, sc.partial)


# --- a gateway's 502/503 in front of a vLLM or SGLang: a failed scrape, not a down, for the counter's logic ----------


def _vllm_full(tokens: float, finished: int) -> str:
    return (_vllm_multiprocess(tokens) + "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{model_name="m",finished_reason="length"}} {finished}\n')


def _page(kind: str, tokens: float, finished: int) -> str:
    return _sglang_full(tokens, 0, finished, 2.0 * finished) if kind == "sglang" else _vllm_full(tokens, finished)


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
@pytest.mark.parametrize("blips", [1, 2])
def test_a_gateways_503_blip_before_a_counter_that_went_on_leaves_its_window_whole(kind, blips, monkeypatch):
    # A router or nginx answers /metrics 503 for a scrape or two in front of a live SGLang (or a vLLM with several
    # API servers: no start time), which went on counting (1000 tokens a second, 100000 → 101000 → 102000). Read as
    # the server found down, the window back was marked counter_below (a restart warning, its rows out of J/token)
    # though nothing restarted; the 503 is a failed scrape, the window whole: no new process counts 101000 from 0 in
    # 2-3 s at 4 times the server's highest rate (BLIP_RATE_MARGIN), and no count on the page went back.
    script = ([_page(kind, 99000, 990), _page(kind, 100000, 1000)] + ["503"] * blips
              + [_page(kind, 101000, 1010), _page(kind, 102000, 1020)])
    deltas, sc = _scrapes(kind, script, period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, 1000] + [None] * blips + [1000, 1000], deltas  # the truth: 1000 tokens a second
    assert sc.partial == {} and sc.restarts == 0 and sc.below == 0 and sc.errors == blips, (sc.partial, sc.below)


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_gateways_503_blip_with_no_rate_known_is_said(kind, monkeypatch):
    # a9b9bfd2 kept 1000, 503, 1040 (finished 10 → 11) whole with no rate seen: a new process of the same mix passes
    # the old reading and finished count together (SGLang raises both in one call), and with no rate known nothing
    # says it could not have. Said as after a down (counter_below), the count kept: 40, none made up.
    deltas, sc = _scrapes(kind, [_page(kind, 1000, 10), "503", _page(kind, 1040, 11), _page(kind, 1080, 12)],
                          period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, None, 40, 40] and "counter_below" in sc.partial and sc.below == 1, (deltas, sc.partial)


def test_a_young_sglang_restarted_behind_a_503_past_its_reading_and_finished_count_is_said(monkeypatch):
    # The review's case: the old process at 130 tokens, 2 finished (3.0 s), 65 tokens a second; behind a 503 a new one
    # made 140 tokens in 2 requests (3.5 s): past every count. Truth: the window's 140 tokens are the new process's.
    # a9b9bfd2 (over 64 tokens, no count back) counted 10 unsaid; now 140 is within 4 x 65 x 2 s: said, 10 kept.
    script = [_sglang_full(0, 0, 0, 0.0), _sglang_full(65, 0, 1, 1.5), _sglang_full(130, 0, 2, 3.0), "503",
              _sglang_full(140, 0, 2, 3.5), _sglang_full(172, 0, 3, 4.0)]
    deltas, sc = _scrapes("sglang", script, period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, 65, 65, None, 10, 32] and "counter_below" in sc.partial and sc.below == 1, (deltas, sc.partial)


@pytest.mark.parametrize("pages, counted", [
    # A gateway failing over after one 503 from replica A to an older, busier replica B (6 s a request): B's 19000
    # since A's reading are not A's window. 941923a0's age proof (a request on the page longer than the 2 s since the
    # last believed page) skipped the rise bound too and counted them whole, unsaid.
    ([_sglang_full(0, 0, 0, 0.0), _sglang_full(500, 0, 5, 10.0), _sglang_full(1000, 0, 10, 20.0), "503",
      _sglang_full(20000, 0, 200, 1200.0)], 19000),
    # A young server restarted behind the 503: its new process ran one /generate whose client set received_time (SGLang's
    # GenerateReqInput takes it from the body and times the request from it: 1.7e9 s). The proof read it as the old
    # process and counted 32 of the new one's 162, unsaid.
    ([_sglang_full(0, 0, 0, 0.0), _sglang_full(65, 0, 1, 1.0), _sglang_full(130, 0, 2, 2.0), "503",
      _sglang_full(162, 0, 3, 1.7e9)], 32),
    # The same young server back whole with requests of 5 s: nothing on the page proves it the same process (the
    # request ages above can be a client's or another replica's), so it is said, an over-flag (its rows out of J/token).
    ([_sglang_full(0, 0, 0, 0.0), _sglang_full(65, 0, 1, 5.0), _sglang_full(130, 0, 2, 10.0), "503",
      _sglang_full(162, 0, 3, 15.0)], 32),
])
def test_a_young_sglang_back_from_a_503_is_said_whatever_its_requests_ages(pages, counted, monkeypatch):
    # Within 4 x its peak x the seconds since the last believed page: the pace bounds cannot tell it, so it is said
    # (counter_below), the count kept; no request age on the page makes it whole.
    deltas, sc = _scrapes("sglang", list(pages), period_s=1.0, monkeypatch=monkeypatch)
    assert deltas[3:] == [None, counted] and "counter_below" in sc.partial and sc.below == 1, (deltas, sc.partial)


@pytest.mark.parametrize("offset_s", [0.03, 0.06])
def test_a_proxy_refusal_while_the_last_pages_get_was_in_flight_finds_the_server_down(offset_s, monkeypatch):
    # 100, 150, a restart no scrape saw, 400 (1 s scrapes, each GET 50 ms), the daemon's proxy forwarding to the same
    # server refused `offset_s` after the 150 page's GET began: during it (the server answered that GET, then closed its
    # listener: uvicorn's graceful shutdown does so first), or after its answer. Either way the death lies after that
    # GET began, in the next window: its page at or past the old reading is said (counter_below), the 250 kept. Before,
    # only refusals after the answer counted: the one during the GET was dropped, 250 whole, unsaid.
    import types

    from powerprof.daemon import scrape

    clock = [1000.0]
    monkeypatch.setattr(scrape, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0]))
    pages, box = [_sglang(100), _sglang(150), _sglang(400)], []

    class Timed(Scraper):
        async def _get(self, path):
            clock[0] += 0.05
            return 200, pages.pop(0)

    async def go():
        async with aiohttp.ClientSession() as s:
            sc = Timed(s, "http://x", "sglang")
            sc.refusals = lambda: [box.pop() for _ in range(len(box))]
            out = []
            for i in range(3):
                start = clock[0]
                out.append((await sc.scrape(), sc.window_partial, sc.window_down_refused))
                if i == 1:
                    box.append(int((start + offset_s) * 1e9))
                clock[0] = start + 1.0
            return out, sc

    got, sc = asyncio.run(go())
    assert got == [(0.0, (), False), (50.0, (), False), (250.0, ("counter_below",), True)], got


def _two_proxy_workers():
    """ProxyWorkers(2) on stand-in transports, the idle one's heartbeat said now: the workers, the busy one's link."""
    import time
    from types import SimpleNamespace

    from powerprof.daemon.workers import _STATS, ProxyWorkers, _WorkerLink, frame

    workers = ProxyWorkers(2, "http://unused", "127.0.0.1", 0, recorder=None, proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    for w in workers.workers:
        w.transport = SimpleNamespace(close=lambda: None)
    busy, idle = (_WorkerLink(workers, w) for w in workers.workers)
    idle.data_received(frame(([], [], [], [], (0,) * len(_STATS), [], time.monotonic_ns(), [])))
    return workers, busy


def _hears_refusals_of(sc: Scraper, workers) -> None:
    """The scraper takes (and waits for) the workers' refusals, as the daemon wires it."""
    sc.refusals, sc.refusals_wait = workers.take_refusals, workers.wait_refusals
    sc.refusals_late_s = workers.refusals_late_s


async def _refusal_flushed_10ms_in(busy) -> int:
    """A worker's connect refused now, flushed by the busy worker FLUSH_S after; 10 ms slept. The refusal's time."""
    import time

    from powerprof.daemon.workers import _STATS, FLUSH_S, frame

    refused = time.monotonic_ns()

    def flush():
        busy.data_received(frame(([], [], [], [], (0,) * len(_STATS), [], time.monotonic_ns(), [refused])))

    asyncio.get_running_loop().call_later(FLUSH_S, flush)
    await asyncio.sleep(0.01)
    return refused


def test_a_proxy_workers_refusal_flushed_after_the_scrape_began_finds_the_server_down():
    # 100, 150, a restart no scrape saw, 400, proxy.workers = 2: a worker's connect refused 10 ms before the third
    # scrape began reaches the daemon in its flush FLUSH_S (20 ms) after the refusal, 10 ms into that scrape; the other
    # worker is idle (its clock last said at its heartbeat). Before, the scraper took the refusals as it began, found
    # none, and the next scrape dropped this one as older than its window: 250 whole, unsaid. Now it waits after its page
    # for the workers' records up to its start (ProxyWorkers.wait_refusals, bounded by REFUSALS_LATE_S): said.
    pages = [_sglang(100), _sglang(150), _sglang(400)]

    class Paged(Scraper):
        async def _get(self, path):
            return 200, pages.pop(0)

    async def go():
        workers, busy = _two_proxy_workers()
        async with aiohttp.ClientSession() as s:
            sc = Paged(s, "http://x", "sglang")
            _hears_refusals_of(sc, workers)
            out = [(await sc.scrape(), sc.window_partial, sc.window_down_refused) for _ in range(2)]
            await _refusal_flushed_10ms_in(busy)
            out.append((await sc.scrape(), sc.window_partial, sc.window_down_refused))
            return out

    got = asyncio.run(go())
    assert got == [(0.0, (), False), (50.0, (), False), (250.0, ("counter_below",), True)], got


def test_a_vllm_restarted_behind_a_503_with_as_many_requests_finished_is_said(monkeypatch):
    # A vLLM with several API servers (no start time): the old process 300 tokens in 3 requests at 100 tokens a second,
    # the new one behind a 503 330 tokens in 3 (an equal finished count is no "went back"). Truth: 330 the new
    # process's; a9b9bfd2 counted 30 unsaid. Now within 4 x 100 x 2 s: said, 30 kept.
    script = [_vllm_full(200, 2), _vllm_full(300, 3), "503", _vllm_full(330, 3), _vllm_full(430, 4)]
    deltas, sc = _scrapes("vllm", script, period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, 100, None, 30, 100] and "counter_below" in sc.partial and sc.below == 1, (deltas, sc.partial)


def test_a_retry_herd_on_a_new_process_behind_a_503_rising_past_the_servers_pace_is_said(monkeypatch):
    # The second review's scripted repros. A vLLM with several API servers (no start time), 200 tokens a second at light
    # load; restarted behind three 503s, its clients' retry herd ran the new one at 1000 a second: 3500 tokens by the
    # page back, past the old reading and the reach (4 x 200 x 4 s = 3200). Truth: 3500 the new process's. Before
    # counted 2900 of them unsaid; its rise, 2900 in 4 s, is over 1.25 x 200 x 4 s = 1000: said, 2900 kept.
    script = [_vllm_full(200, 2), _vllm_full(400, 4), _vllm_full(600, 6), "503", "503", "503",
              _vllm_full(3500, 35), _vllm_full(4500, 45)]
    seen: list = []
    deltas, sc = _scrapes("vllm", script, seen, period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, 200, 200, None, None, None, 2900, 1000] and sc.below == 1, (deltas, sc.partial)
    assert "counter_below" in sc.partial and sc.restarts == 0, sc.partial
    # SGLang (at finish): one 100-token request a second (peak 100/s), a herd of 64 on the new process by the page
    # back: 6400 past the reach (4 x 100 x 4 s). Before counted 6100 of 6400 unsaid; its rise is over 1.25 x 100 x 4 s.
    script = [_sglang_full(0, 0, 0, 0.0), _sglang_full(100, 0, 1, 2.0), _sglang_full(200, 0, 2, 4.0),
              _sglang_full(300, 0, 3, 6.0), "503", "503", "503",
              _sglang_full(6400, 0, 64, 128.0), _sglang_full(12800, 0, 128, 256.0)]
    deltas, sc = _scrapes("sglang", script, period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, 100, 100, 100, None, None, None, 6100, 6400] and sc.below == 1, (deltas, sc.partial)


def test_a_finished_count_read_nan_after_a_503_is_said(monkeypatch):
    # A NaN compares as neither below nor above: vllm:request_success_total NaN after a 503 passed as "not gone back",
    # the window whole. Not comparable, it is read as gone back: said, the count kept.
    nan_page = _vllm_multiprocess(101000) + ('# TYPE vllm:request_success_total counter\n'
                                            'vllm:request_success_total{model_name="m",finished_reason="length"} NaN\n')
    deltas, sc = _scrapes("vllm", [_vllm_full(99000, 990), _vllm_full(100000, 1000), "503", nan_page,
                                   _vllm_full(102000, 1020)], period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, 1000, None, 1000, 1000] and sc.below == 1 and "counter_below" in sc.partial, (deltas, sc.partial)


def _vllm_reasons(tokens: float, stop: int, length: int) -> str:
    return (_vllm_multiprocess(tokens) + "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{model_name="m",finished_reason="stop"}} {stop}\n'
            f'vllm:request_success_total{{model_name="m",finished_reason="length"}} {length}\n')


def _sglang_tenants(a: float, b: float, a_done: int, b_done: int) -> str:
    # Two models' series (a tenant each): their token counters and finished-request histograms, a label set each.
    name, lat = "sglang:generation_tokens_total", "sglang:e2e_request_latency_seconds"
    out = f"# TYPE {name} counter\n" + "".join(f'{name}{{model_name="{m}"}} {n}\n' for m, n in (("a", a), ("b", b)) if n)
    out += f"# TYPE {lat} histogram\n"
    for m, n in (("a", a_done), ("b", b_done)):
        if n:
            out += (f'{lat}_bucket{{le="+Inf",model_name="{m}"}} {n}\n{lat}_count{{model_name="{m}"}} {n}\n'
                    f'{lat}_sum{{model_name="{m}"}} {2.0 * n}\n')
    return out


@pytest.mark.parametrize("kind,pages", [
    # Summed, these rise; per label set one went back (a new process serving another mix): its window said.
    ("vllm", [_vllm_reasons(99000, 990, 0), _vllm_reasons(100000, 1000, 0), "503", _vllm_reasons(100040, 0, 1012)]),
    ("sglang", [_sglang_tenants(99000, 0, 990, 0), _sglang_tenants(100000, 0, 1000, 0), "503",
                _sglang_tenants(0, 100040, 0, 1012)]),
])
def test_a_count_gone_back_in_one_label_set_after_a_503_is_said(kind, pages, monkeypatch):
    # Past the rate bound (1000 tokens a second seen; a rate seen at light load may be below a new process's), the
    # page's counts are held to the last believed page's per label set: vLLM's finished "stop" 1000 → 0 beside "length"
    # 0 → 1012, SGLang's model "a" (tokens and finished requests) gone beside "b" at 100040 tokens and 1012 requests.
    # a9b9bfd2 summed them (1000 → 1012 finished): whole.
    deltas, sc = _scrapes(kind, pages, period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, 1000, None, 40] and "counter_below" in sc.partial and sc.below == 1, (deltas, sc.partial)


def test_a_dip_after_a_503_with_every_finished_count_on_is_held_as_a_dip(monkeypatch):
    # The review's LOW item: 100000, 503, 99990 (finished 1000 → 1001), 100050 on one process. Taken for a proven
    # restart, the window counted 99990 phantom tokens (server_restart) and the next 60 where 50 ran, unsaid. Every
    # finished count at or past the last believed page's: a dip, held; 50 counted, the truth, nothing marked.
    script = [_sglang_full(99000, 0, 990, 1980.0), _sglang_full(100000, 0, 1000, 2000.0), "503",
              _sglang_full(99990, 0, 1001, 2002.0), _sglang_full(100050, 0, 1002, 2004.0)]
    deltas, sc = _scrapes("sglang", script, period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, 1000, None, None, 50] and sc.restarts == 0 and sc.dips == 1, (deltas, sc.partial)
    assert sc.partial == {}, sc.partial


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_restart_behind_a_gateways_503_is_still_told(kind, monkeypatch):
    # A router answering 503 while the server behind it restarts (scrapes 1 s apart: a new process could have counted
    # 1040 tokens from 0 since the page before, FASTEST_SERVER_TOKENS_PER_S). The counter fallen (above half of it,
    # where a fall with no sign is held as a dip): a restart at once, the new process's counted from 0, as before.
    deltas, sc = _scrapes(kind, [_page(kind, 1000, 10), "503", "503", _page(kind, 600, 6), _page(kind, 640, 7)],
                          period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, None, None, 600, 40] and sc.restarts == 1 and "server_restart" in sc.partial, deltas
    assert sc.dips == 0
    # Its finished count went back (10 → 6), but a multi-process page's lag reads so too: told by the fall alone, so
    # the window after it says fall_unconfirmed (a9b9bfd2 took it as proven: the next window unmarked).
    assert sc.window_partial == ("fall_unconfirmed",), sc.window_partial
    # Its new process past the old reading by its first page, its finished requests below the old process's (a new
    # process counts them from 0): another process, its window said as after a refusal (counter_below).
    deltas, sc = _scrapes(kind, [_page(kind, 1000, 10), "503", _page(kind, 1040, 4), _page(kind, 1080, 5)],
                          period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, None, 40, 40] and "counter_below" in sc.partial and sc.window_partial == (), deltas
    # A page with no finished-request count to tell by: said, as before.
    deltas, sc = _scrapes("sglang", [_sglang(1000), "503", _sglang(1040), _sglang(1080)],
                          period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, None, 40, 40] and "counter_below" in sc.partial, deltas
    # Nothing listening (a refusal) is a death whatever the marks say: said.
    deltas, sc = _scrapes(kind, [_page(kind, 1000, 10), DOWN, _page(kind, 1040, 11), _page(kind, 1080, 12)],
                          period_s=1.0, monkeypatch=monkeypatch)
    assert deltas == [0, None, 40, 40] and "counter_below" in sc.partial, deltas


def _counted(server_tokens) -> bool:
    """Whether a row's `server_tokens` is a count: null (None, or NaN as pandas reads it) is no count at all, the row
    not scraped or before the first read (docs/data.md), not zero bypass tokens."""
    return server_tokens is not None and server_tokens == server_tokens


def bypass_counted(rows: list[dict]) -> float:
    """The bypass tokens the rows count (`server_tokens`), the rows with no count left out (`rows_no_count`)."""
    return float(sum(r["server_tokens"] for r in rows if _counted(r["server_tokens"])))


def blip_run(tmp_path, restart_at_s: float | None = None, blip_at_s: float | None = None, lag_s: float = 0.0,
             run_s: float = 4.0, bypass_lanes: int = 0, flavour: str = "sglang", long_lanes: int = 0,
             direct: bool = False, scrape_s: float = 0.25, workers: int = 1, blip_old_s: float | None = None) -> dict:
    """A daemon in front of a simulated SGLang (continuous batching), scraping it through a router stub that forwards
    /metrics and answers 503 (nginx's page) from `blip_at_s` for `lag_s` (a blip, nothing restarts), and while the
    server behind it refuses and for `lag_s` after (a readiness probe's lag: the server restarts at `restart_at_s`,
    down 0.3 s). 2 proxied lanes and `bypass_lanes` straight to the server of 32-token streams for `run_s`, and
    `long_lanes` more of 512-token streams (about 4.5 s each); `direct`: scraped straight, not through the stub, every
    `scrape_s`; `flavour`
    the server simulated (and scraped as); `workers`: proxy.workers; `blip_old_s`: the blip waits past `blip_at_s` until
    the daemon's count is beyond what a new process could count in that many seconds at BLIP_RATE_MARGIN times the
    server's highest rate the daemon saw (the scraper's own reach bound: a server that old by its own pace), and the
    lanes run `run_s - blip_at_s` past the blip. Returns
    the rows' marks, what was left out of J/token, and the bypass tokens counted (server_tokens) and run (the truth)."""
    import time

    from aiohttp import web
    from daemon_helpers import read_dataset
    from powerprof.daemon.config import load_config
    from powerprof.daemon.service import Daemon
    from powerprof.rig import Rig
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    nvml = SimNVML("a100-40g", state_path=None)
    srv = SimServer(nvml, flavour=flavour, n_slots=16, batching="continuous", decode_tok_s=200.0, draft_n_max=0).start()
    nginx = "<html><body><h1>503 Service Temporarily Unavailable</h1></body></html>"
    router = {"503_until": 0.0, "answered_503": 0, "blip_ns": None}

    async def go():
        async with aiohttp.ClientSession() as s:
            async def forward(request):
                if time.monotonic() < router["503_until"]:
                    router["answered_503"] += 1
                    return web.Response(status=503, text=nginx, content_type="text/html")
                try:
                    async with s.get(srv.url + request.path) as r:
                        return web.Response(status=r.status, body=await r.read(), content_type="text/plain")
                except aiohttp.ClientConnectionError:  # the server behind it down: 503 until its health check passes
                    router["answered_503"] += 1
                    router["503_until"] = time.monotonic() + 0.3 + lag_s
                    return web.Response(status=503, text=nginx, content_type="text/html")

            app = web.Application()
            app.router.add_get("/{tail:.*}", forward)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            port = runner.addresses[0][1]
            cfg = load_config(None, env={}, overrides={
                "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 0.25, "daemon.flush_interval_s": 0.5,
                "proxy.listen": "127.0.0.1:0", "proxy.upstream": srv.url, "metrics.listen": "",
                "scrape.url": srv.url if direct else f"http://127.0.0.1:{port}", "daemon.restore_on_start": False,
                "scrape.interval_s": scrape_s, "proxy.workers": workers,
                "tags.socket": str(tmp_path / "pp.sock"), "scrape.server": flavour})
            daemon = Daemon(cfg, Rig("a100-40g", nvml=nvml, host=False))
            task = asyncio.create_task(daemon.run())
            while "proxy" not in daemon.urls:
                assert not task.done(), "the daemon ended before it listened"
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            sent, end = [0], [t0 + run_s if blip_old_s is None else float("inf")]  # set at the blip

            async def lane(base, tag, max_tokens=32):
                body = {"model": "m", "prompt": "x " * 20, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
                while time.monotonic() < end[0]:
                    sent[0] += 1
                    try:
                        async with s.post(base + "/v1/completions", json=body,
                                          headers={"X-Sim-Request-Id": f"{tag}{sent[0]}"}) as r:
                            await r.read()
                    except aiohttp.ClientError:
                        pass  # a stream the restart cut
                    await asyncio.sleep(0.05)

            async def events():
                if blip_at_s is not None:
                    await asyncio.sleep(blip_at_s)
                    sc = daemon.scraper
                    while blip_old_s is not None and sc.total <= BLIP_RATE_MARGIN * sc._peak_tok_s * blip_old_s:
                        assert time.monotonic() - t0 < 60, (sc.total, sc._peak_tok_s)
                        await asyncio.sleep(0.05)
                    end[0] = time.monotonic() + run_s - blip_at_s
                    router["503_until"] = time.monotonic() + lag_s
                    router["blip_ns"] = (time.monotonic_ns(), int(router["503_until"] * 1e9))
                if restart_at_s is not None:
                    await asyncio.sleep(restart_at_s)
                    # The gateway's own health check sees the server go (not a scrape that must land in its 0.3 s down:
                    # on a loaded host none did, and the scene had no 503 at all).
                    router["503_until"] = time.monotonic() + 0.3 + lag_s
                    await asyncio.wrap_future(srv.restart(0.3))

            lanes = [lane(daemon.urls["proxy"], "prox") for _ in range(2)]
            lanes += [lane(srv.url, "byp") for _ in range(bypass_lanes)]
            lanes += [lane(srv.url, "byp", 512) for _ in range(long_lanes)]
            await asyncio.gather(*lanes, events())
            await asyncio.sleep(1.0)
            daemon.stop_event.set()
            await task
            await runner.cleanup()
            return daemon

    try:
        daemon = asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        srv.stop()
    rows = read_dataset(tmp_path / "data", "intervals").to_dict("records")
    marks = [r["server_count"] or "" for r in rows]
    near = []  # the counter_below rows over the blip +- one scrape, as (start, end) since the daemon's start
    if router["blip_ns"] is not None:
        lo, hi = ((t - daemon.ledger.t0_ns) / 1e9 for t in router["blip_ns"])
        near = [(r["t_start_mono_s"], r["t_start_mono_s"] + r["duration_s"]) for r, m in zip(rows, marks)
                if "counter_below" in m and r["t_start_mono_s"] < hi + scrape_s
                and r["t_start_mono_s"] + r["duration_s"] > lo - scrape_s]
    return {
        "answered_503": router["answered_503"],
        "rows": len(rows),
        "rows_complete": sum(m == "complete" for m in marks),
        "marks": sorted({m for m in marks if m != "complete"}),
        "rows_counter_below": sum("counter_below" in m for m in marks),
        "counter_below_near_blip": near,
        "scraper_said_below": daemon.scraper.below,  # the scraper's own counter_below pages (`Scraper._said_below`)
        "rows_server_restart": sum("server_restart" in m for m in marks),
        "restarts_told": daemon.scraper.restarts,
        "jpt_left_out": dict(daemon.ledger.totals.jpt_left_out),
        "bypass_counted": bypass_counted(rows),
        "rows_no_count": sum(not _counted(r["server_tokens"]) for r in rows),
        "bypass_run": sum(t["generated"] for k, t in srv.request_truth().items() if k.startswith("byp")),
    }


def test_blip_runs_bypass_count_leaves_out_rows_with_no_count():
    """A row's null `server_tokens` (NaN from the parquet) is no count (docs/data.md): left out of blip_run's
    bypass_counted, not summed. Before, `r["server_tokens"] or 0` let the NaN through (it is truthy): one run's
    bypass_counted came out NaN, failing every bound on it with no figure to read."""
    rows = [{"server_tokens": 3.0}, {"server_tokens": float("nan")}, {"server_tokens": None}, {"server_tokens": 0.5}]
    assert bypass_counted(rows) == 3.5
    assert [_counted(r["server_tokens"]) for r in rows] == [True, False, False, True]


def test_a_simulated_sglang_behind_a_routers_503_blip_keeps_its_windows_whole(tmp_path):
    """Before a9b9bfd2: the router's 503s read as the server found down, and the first window back said counter_below
    (its intervals out of J/token) though the server never restarted and its counter never dipped. Now whole, and its
    bypass count exact, where the server has run long enough that no new process could have reached its counter in the
    blip at 4 times its own highest rate (6 s here; before a9b9bfd2: 3936 of 3936 bypass tokens, 8 of 75 rows
    counter_below, 7 intervals out of J/token; now 3872 of 3872, 74 of 74 rows complete). A blip 1.5 s into a run is
    still said (too young to tell: 8 rows). On a loaded host the server 6 s old may be that young by its own pace (its
    count lower, its highest rate over a window no lower, the page back later): so the blip waits until it is 1.5 s
    old by that bound (`blip_run`'s `blip_old_s`: the blip's 0.4 s, a 0.25 s scrape and 0.85 s of lateness)."""
    got = blip_run(tmp_path, blip_at_s=6.0, lag_s=0.4, run_s=7.0, bypass_lanes=6, blip_old_s=1.5)
    assert got["answered_503"] >= 1, got
    assert got["rows_counter_below"] == 0 and got["rows_server_restart"] == 0 and got["restarts_told"] == 0, got
    assert not any("counter_below" in k or "restart" in k for k in got["jpt_left_out"]), got
    assert abs(got["bypass_counted"] - got["bypass_run"]) <= 1 + 0.05 * got["bypass_run"], got


def test_a_simulated_sglang_with_long_requests_restarted_behind_a_gateways_readiness_lag_is_still_said(tmp_path):
    got = blip_run(tmp_path, restart_at_s=5.0, lag_s=3.0, run_s=9.5, bypass_lanes=6, long_lanes=1)
    print(got)
    assert got["answered_503"] >= 2, got
    assert got["bypass_counted"] <= got["bypass_run"] * 1.05 + 1, got
    assert got["rows_counter_below"] + got["rows_server_restart"] > 0 and got["jpt_left_out"], got


def test_a_restart_between_scrapes_that_the_proxys_refused_connects_saw_is_said(tmp_path):
    """Restarted 1 s into the run (down 0.3 s) between 2 s scrapes of the server itself, the proxy forwarding to it:
    no scrape found it down, and its new process passed the old reading by the next page. Before, read as traffic: 68
    of 68 rows complete, 2407 of 3008 bypass tokens counted (-20%), unsaid. The proxy's refused connects find it down
    (Scraper._proxy_refused): 28 of 70 rows counter_below, 17 intervals out of J/token, 2536 of 3136, none made up."""
    got = blip_run(tmp_path, restart_at_s=1.0, run_s=6.0, bypass_lanes=6, direct=True, scrape_s=2.0)
    assert got["bypass_counted"] <= got["bypass_run"] * 1.05 + 1, got  # nothing made up
    # A restart loses the old process's tokens since the last page: said every run (asked only where more than 5% of
    # the bypass tokens went missing, it hid the run whose first page back read the new process's warm-up count, 2,
    # as the old one idle: 2687 of 3072 counted, 80 of 80 rows complete).
    assert got["rows_counter_below"] + got["rows_server_restart"] > 0 and got["jpt_left_out"], got


def test_a_restart_between_scrapes_that_proxy_workers_refused_connects_saw_is_said(tmp_path):
    """As above with proxy.workers = 2: the workers' refused connects ride in their records (workers.ShippingRecorder)
    and find the server down as the in-process proxy's do."""
    got = blip_run(tmp_path, restart_at_s=1.0, run_s=6.0, bypass_lanes=6, direct=True, scrape_s=2.0, workers=2)
    assert got["bypass_counted"] <= got["bypass_run"] * 1.05 + 1, got  # nothing made up
    assert got["rows_counter_below"] + got["rows_server_restart"] > 0 and got["jpt_left_out"], got


def test_a_simulated_sglang_restarting_behind_a_routers_503_is_still_told(tmp_path):
    # The router answers 503 while the server behind it is down (no scrape refused): its new counter fell, a restart.
    got = blip_run(tmp_path, restart_at_s=1.5)
    assert got["answered_503"] >= 1, got
    assert got["restarts_told"] == 1 and got["rows_server_restart"] >= 1, got


def test_a_simulated_sglang_restarted_behind_a_gateways_readiness_lag_is_said_not_hidden(tmp_path):
    """The review's scene: the old process 2 s old, restarted behind a gateway that answers 503 while it refuses and
    for 3 s after it is back (a readiness probe's lag), 6 bypass lanes straight to it: the new process passed the old
    reading and every finished count by the first page through. After a9b9bfd2 all 73 rows said `complete` with 1940 of
    3296 bypass tokens counted (-41%), nothing left out. Now held to the rate bound: 41 of 73 rows counter_below, 29
    intervals left out of J/token, 1971 of 3328 counted (none made up), as before a9b9bfd2 (42 rows, 33 out)."""
    got = blip_run(tmp_path, restart_at_s=2.0, lag_s=3.0, run_s=6.5, bypass_lanes=6)
    assert got["answered_503"] >= 2, got
    assert got["bypass_counted"] <= got["bypass_run"] * 1.05 + 1, got  # nothing made up
    # The scene hides tokens (the new process's up to the old reading are in no count): the windows must say so.
    assert got["bypass_counted"] < 0.95 * got["bypass_run"], got
    assert got["rows_counter_below"] + got["rows_server_restart"] > 0 and got["jpt_left_out"], got


def test_a_simulated_llamacpp_restarted_behind_a_gateways_readiness_lag_is_said_not_hidden(tmp_path):
    """The second review's llama.cpp scene: the old process 1.5 s old, restarted behind a gateway that answers 503 while
    it refuses and for 3 s after it is back, 2 bypass lanes: its new process passed both counters by the first page
    through. Before, the gateway's 503 was a plain failed scrape: 0 restarts told, no row marked, bypass 1153 of 1728
    counted (-33%), proxied J/token 1.067 for a truth of 0.700. Now held to the server's pace: said (the review's run:
    49 of 95 rows counter_below, 44 intervals left out of J/token, 1152 of 1728 counted, none made up)."""
    got = blip_run(tmp_path, restart_at_s=1.5, lag_s=3.0, run_s=6.0, bypass_lanes=2, flavour="llamacpp")
    assert got["answered_503"] >= 2, got
    assert got["bypass_counted"] <= got["bypass_run"] * 1.05 + 1, got  # nothing made up
    assert got["bypass_counted"] < 0.95 * got["bypass_run"], got  # the scene hides tokens: the windows must say so
    assert got["rows_counter_below"] + got["rows_server_restart"] > 0 and got["jpt_left_out"], got


def test_a_simulated_llamacpp_behind_a_routers_503_blip_keeps_its_windows_whole(tmp_path):
    """A gateway's 503 for 0.4 s 6 s into the run, nothing restarted: whole (sent to `_down_back` instead, as a down,
    the review's prototype marked 7 rows counter_below; the review's run now: 2560 of 2560 counted, no row marked).
    Beside two CPU hogs the server 6 s old was too young by its own pace (3 runs in 6: 2908 tokens, within the 3243 a
    new process could have counted at 4 x 769 a second in the 1.05 s since its last believed page), rightly said: the
    blip waits until it is 1.5 s old by that bound, as the SGLang scene's. Then 12 runs in 17 still had 4-16 rows
    counter_below, none said by the scraper, most away from the blip (1.2 s and 7.9 s into a 15 s run, the blip near
    13 s): the count reconciler's windows whose count lost tokens nothing explains (`reconcile._lost_beyond`, with
    proxy_lag: a loaded host's proxy late behind llama-server's end-of-request counter), out of J/token and said, not
    the blip's doing. So the blip's own judgment is what is held here: the scraper said no page counter_below (sent
    to `_down_back`, as a down, it would), told no restart, no row over the blip +- one scrape is counter_below (one
    the reconciler flagged there would hide a blip said so), and the count is exact."""
    got = blip_run(tmp_path, blip_at_s=6.0, lag_s=0.4, run_s=7.0, bypass_lanes=2, flavour="llamacpp", blip_old_s=1.5)
    assert got["answered_503"] >= 1, got
    assert got["scraper_said_below"] == 0 and got["counter_below_near_blip"] == [], got
    assert got["rows_server_restart"] == 0 and got["restarts_told"] == 0, got
    assert abs(got["bypass_counted"] - got["bypass_run"]) <= 1 + 0.05 * got["bypass_run"], got


def _llamacpp_refusal_flushed_into_the_third_scrape(bad_slots: str | None) -> tuple[list, Scraper, int]:
    """llama.cpp, proxy.workers = 2, pages 100 (task 1 decoding 10), 150 (task 2 decoding 20: task 1 ended, the counter
    read again), a restart no scrape saw, 400 (task 3 decoding 5: read again, 440, a 40-token answer ended after
    /slots; or /slots the page `bad_slots`, unreadable: the scrape fails), 450 (task 3 decoding 10). A worker's connect refused
    10 ms before the third scrape began reaches the daemon in its flush 10 ms into it; the other worker is idle (its
    clock last said at its heartbeat). Gives each scrape's (delta, window_partial, window_down_refused,
    window_read_missed, down_open(), paths asked), the scraper and the refusal's time."""
    import json


    def slots(task, n):
        return json.dumps([{"id": 0, "id_task": task, "is_processing": True, "next_token": [{"n_decoded": n}]}])

    # (the counter, /slots, the counter read again)
    steps = [(100, slots(1, 10), 100), (150, slots(2, 20), 150), (400, bad_slots or slots(3, 5), 440),
             (450, slots(3, 10), 450)]
    asked: list[str] = []

    class Paged(Scraper):
        step = None

        async def _get(self, path):
            asked.append(path)
            if path == "/metrics":
                first = self.step is None
                if first:
                    self.step = steps.pop(0)
                c = self.step[0] if first else self.step[2]
                return 200, f"# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total {c}\n"
            return 200, self.step[1]

    async def go():
        workers, busy = _two_proxy_workers()
        async with aiohttp.ClientSession() as s:
            sc = Paged(s, "http://x", "llamacpp")
            _hears_refusals_of(sc, workers)
            out = []

            async def one():
                asked.clear()
                sc.step = None
                d = await sc.scrape()
                out.append((d, sc.window_partial, sc.window_down_refused, sc.window_read_missed, sc.down_open(),
                            tuple(asked)))

            for _ in range(2):
                await one()
            refused = await _refusal_flushed_10ms_in(busy)
            await one()
            await one()
            return out, sc, refused

    return asyncio.run(go())


def test_a_proxy_workers_refusal_flushed_into_a_llamacpp_scrape_that_reads_the_counter_again_finds_the_server_down():
    # The counter's second read comes before the wait for the workers' refusals (Scraper._scrape_llamacpp): the
    # refusal flushed in the wait is still judged against this scrape's page (250 past the old reading: said).
    got, sc, refused = _llamacpp_refusal_flushed_into_the_third_scrape(bad_slots=None)
    assert [g[:4] for g in got] == [(0.0, (), False, 0.0), (60.0, (), False, 0.0),
                                    (235.0, ("counter_below",), True, 40.0), (55.0, (), False, 0.0)], got
    assert got[2][5] == ("/metrics", "/slots", "/metrics"), got[2]


@pytest.mark.parametrize("bad_slots", ["{not json", "[" * 100_000 + "]" * 100_000,
                                       '[{"id": 0, "id_task": 3, "is_processing": true, "next_token": [null]}]'],
                         ids=["not-json", "nested-past-the-stack", "next-token-null"])
def test_a_proxy_workers_refusal_flushed_into_a_llamacpp_scrape_whose_slots_are_unreadable_is_open_at_once(bad_slots):
    # /slots unreadable fails the scrape, which still waits for the workers' refusals up to its start: the death is
    # open (down_open, the ledger's note_down) from this scrape on. Before, the failed scrape took them at once, without
    # the wait, and the refusal flushed 10 ms in was open only a scrape later; the next page is said either way. Only a
    # ValueError waited: one nested past Python's stack (RecursionError) or a null where a slot's next_token is
    # (AttributeError) still fell to scrape()'s catch-all, which takes the refusals without the wait.
    got, sc, refused = _llamacpp_refusal_flushed_into_the_third_scrape(bad_slots=bad_slots)
    assert got[2][0] is None and got[2][4] == (refused, refused), got
    assert got[3][:3] == (290.0, ("counter_below",), True), got
