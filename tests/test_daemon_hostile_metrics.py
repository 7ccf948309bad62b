"""A server whose /metrics page lies (a counter that steps back a little on the same process, a series listed twice):
the scraped token count is never made up from it; the scrape is refused, counted and said."""

from __future__ import annotations

import asyncio

import aiohttp

from hostile_server import HostileServer
from powerprof.daemon.scrape import Scraper


def _scrapes(kind: str, pages: list[str], slots=None) -> tuple[list, Scraper]:
    """The deltas of one Scraper reading `pages` in turn (each its /metrics at one scrape)."""
    with HostileServer(metrics_text=pages[0], slots=slots) as h:
        async def go():
            out = []
            async with aiohttp.ClientSession() as s:
                sc = Scraper(s, h.url, kind)
                for page in pages:
                    h.metrics_text = page
                    out.append(await sc.scrape())
            return out, sc

        return asyncio.run(asyncio.wait_for(go(), 60))


def _vllm(tokens: float, start: float = 1700000000.0) -> str:
    return (f"process_start_time_seconds {start}\n# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{model_name="m"}} {tokens}\n')


def test_a_counter_that_steps_back_on_the_same_process_is_not_taken_for_a_restart():
    # Before: 1_000_000 then 999_990 on the same process (its start time unchanged) was read as a restart and the
    # whole 999_990 counted as tokens of that one window: bypass traffic that never ran, its energy taken from the
    # requests beside it into `unproxied`.
    deltas, sc = _scrapes("vllm", [_vllm(1_000_000), _vllm(999_990), _vllm(1_000_020), _vllm(1_000_050)])
    assert deltas[0] == 0 and deltas[1] is None  # the baseline; the page that went back is not believed
    assert deltas[2] == 20 and deltas[3] == 30  # counted from the highest reading: nothing twice, nothing made up
    assert sc.total == 50 and sc.restarts == 0 and sc.errors == 1
    assert "went back" in sc.last_error and "same process" in sc.last_error


def test_a_real_restart_is_still_a_restart():
    deltas, sc = _scrapes("vllm", [_vllm(1_000_000), _vllm(40, start=1700000500.0), _vllm(100, start=1700000500.0)])
    assert deltas == [0, 40, 60] and sc.restarts == 1


def test_a_llamacpp_counter_that_steps_back_while_its_decode_calls_move_on_is_not_a_restart():
    # llama-server's decode calls (n_decode_total) move every step: a finished-token counter that goes back while they
    # went on is the page's glitch, not a new process. Before: the whole counter counted again as new tokens.
    def page(tokens, steps):
        return (f"llamacpp:tokens_predicted_total {tokens}\nllamacpp:n_decode_total {steps}\n")

    deltas, sc = _scrapes("llamacpp", [page(500_000, 9000), page(499_999, 9010), page(500_010, 9020)], slots=[])
    assert deltas[0] == 0 and deltas[1] is None and deltas[2] == 10
    assert sc.total == 10 and sc.restarts == 0


def test_a_series_listed_twice_fails_the_scrape_instead_of_doubling_the_count():
    # Before: the two samples of one series were summed: every token the server generated counted twice.
    twice = ('# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{model_name="m"} 100\n'
             'vllm:generation_tokens_total{model_name="m"} 100\n')
    deltas, sc = _scrapes("vllm", [twice])
    assert deltas == [None] and sc.errors == 1 and "twice" in sc.last_error
    # Two label sets (two models) are two series, summed as before.
    two = ('# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{model_name="a"} 100\n'
           'vllm:generation_tokens_total{model_name="b"} 50\n')
    deltas, sc = _scrapes("vllm", [two, two.replace(" 50\n", " 70\n")])
    assert deltas == [0, 20] and sc.errors == 0


def test_a_page_of_a_huge_number_of_series_is_refused_before_it_is_parsed():
    # Before: 300 000 series of the token counter (16 MiB, the read bound) were parsed at every scrape: 2.5 s of CPU in
    # the event loop the proxy shares, 4 scrapes a second while traffic moves: every proxied token held back seconds.
    import time

    from powerprof.workload.servercount import counter_total, histogram_sum_count

    page = "# TYPE vllm:generation_tokens_total counter\n" + "".join(
        f'vllm:generation_tokens_total{{model_name="m{i}"}} {i}\n' for i in range(250_000))
    t0 = time.process_time()
    for fn, name in ((counter_total, "vllm:generation_tokens_total"), (histogram_sum_count, "vllm:generation_tokens")):
        try:
            fn(page, name)
        except ValueError as e:
            assert "lines of the page" in str(e)
        else:
            raise AssertionError(f"{fn.__name__} parsed a page of 250 000 series")
    assert time.process_time() - t0 < 0.5  # a count of lines, not a parse (2.5 s each before)
    deltas, sc = _scrapes("vllm", [page])
    assert deltas == [None] and sc.errors == 1 and "not parsed" in sc.last_error


def test_a_counter_split_over_the_page_and_its_line_ends_reads_as_the_whole_page_split_into_lines():
    # Only the stretch of the page from the first line naming a metric to the last is split into lines (a scrape of
    # a vLLM page in half the CPU, bench/scrape_parse.py): a counter whose series are far apart, odd line ends (CRLF,
    # a lone CR, U+2028), or the name past the cap only at the page's two ends read as the whole page's split did.
    import random

    from powerprof.workload.servercount import MAX_METRIC_LINES, _lines_naming, counter_total

    name = "vllm:generation_tokens"
    apart = (f"# TYPE {name}_total counter\r\n{name}_total{{model_name=\"a\"}} 5\r\n"
             + "".join(f"vllm:other_{i}_total 1\r\n" for i in range(50))
             + f"{name}_total{{model_name=\"b\"}} 7\r\nvllm:num_requests_running 1\r\n")
    assert counter_total(apart, name + "_total") == 12.0  # both series, the lines between not read
    assert counter_total(apart.replace("\r\n", "\r"), name + "_total") == 12.0
    assert counter_total(apart.replace("\r\n", "\u2028"), name + "_total") == 12.0
    rng = random.Random(7)
    atoms = [name, "_total", "vllm:gen", " 1", "{a=\"b\"}", "#", " ", "\n", "\r", "\r\n", "\n\r", "\x0b", "\x85",
             "\u2028"]
    for _ in range(3000):
        page = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 40)))
        assert _lines_naming(page, name) == "".join(ln + "\n" for ln in page.splitlines() if name in ln), repr(page)
    half = f"{name}_total 1\n" * (MAX_METRIC_LINES // 2 + 1)
    try:
        counter_total(half + "vllm:other 1\n" * 1000 + half, name + "_total")
    except ValueError as e:
        assert f"named on {MAX_METRIC_LINES + 2} lines" in str(e)
    else:
        raise AssertionError("a page naming the counter past the cap, at its two ends, was parsed")
