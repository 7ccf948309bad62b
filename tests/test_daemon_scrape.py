"""Parsing the servers' own token counters."""

from __future__ import annotations

import asyncio
import json

from powerprof.daemon.scrape import Scraper, counter_total, llamacpp_generated, slot_progress, slots_delta

VLLM = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="a"} 1200.0
vllm:generation_tokens_total{model_name="b"} 34.0
# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3.0
"""

SGLANG = """# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m"} 77.0
"""


def test_counter_sums_label_sets_and_is_none_when_absent():
    assert counter_total(VLLM, "vllm:generation_tokens_total") == 1234.0
    assert counter_total(SGLANG, "sglang:generation_tokens_total") == 77.0
    assert counter_total(VLLM, "sglang:generation_tokens_total") is None


def test_llamacpp_slots_count_progress_and_new_tasks():
    a = slot_progress([{"id": 0, "id_task": 5, "n_decoded": 10}, {"id": 1, "id_task": 6, "n_decoded": 3}])
    b = slot_progress([{"id": 0, "id_task": 5, "n_decoded": 25}, {"id": 1, "id_task": 9, "n_decoded": 4}])
    # slot 0 moved 15; slot 1 started a new task that has decoded 4 so far
    assert slots_delta(a, b) == 19
    assert slots_delta(b, b) == 0
    assert slot_progress({"not": "a list"}) == {}


def test_an_idle_slot_is_not_in_flight_even_if_it_keeps_its_last_count():
    # llama-server resets n_decoded to 0 at the end of a request; older builds kept it.
    kept = slot_progress([{"id": 0, "id_task": 5, "is_processing": False, "next_token": [{"n_decoded": 300}]}])
    assert llamacpp_generated(1000.0, kept) == 1000.0
    busy = slot_progress([{"id": 0, "id_task": 5, "is_processing": True, "next_token": [{"n_decoded": 44}]}])
    assert llamacpp_generated(1000.0, busy) == 1044.0


class _Replay(Scraper):
    """A Scraper whose llama-server answers from a script of (counter or None, slots or None)."""

    def __init__(self, script):
        super().__init__(session=None, base_url="http://x", server="llamacpp")
        self.script = list(script)
        self.step = None

    async def _get(self, path):
        if path == "/metrics":
            self.step = self.script.pop(0)
            c = self.step[0]
            return (200, f"# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total {c}\n") if c is not None else (501, "")
        slots = self.step[1]
        return (200, json.dumps(slots)) if slots is not None else (501, "")


def _slot(task, n, busy=True):
    return [{"id": 0, "id_task": task, "is_processing": busy, "next_token": [{"n_decoded": n}]}]


def _run(sc, n):
    async def go():
        return [await sc.scrape() for _ in range(n)]

    return asyncio.run(go())


def test_llamacpp_counts_every_token_from_the_counter_plus_slots():
    sc = _Replay([
        (0, _slot(1, 0, busy=False)),  # baseline
        (0, _slot(1, 40)),  # request 1 decoding
        (300, _slot(1, 0, busy=False)),  # it ended with 300: the 260 /slots never showed are counted
        (300, _slot(2, 0, busy=False)),  # request 2 started and ended between scrapes ...
        (350, _slot(2, 0, busy=False)),  # ... and the counter has its 50
        (350, _slot(3, 100)),
        (350, None),  # request 3 ended between the two reads: /slots answered 0 too late for the counter
        (500, _slot(3, 0, busy=False)),
    ])
    deltas = _run(sc, 8)
    assert deltas == [0.0, 40.0, 260.0, 0.0, 50.0, 100.0, 0.0, 50.0]
    assert sc.total == 500.0  # exactly what the server generated after the baseline


def test_llamacpp_restart_counts_from_zero_and_slots_only_still_works():
    sc = _Replay([(900, _slot(1, 0, False)), (950, _slot(1, 0, False)), (20, _slot(1, 5))])
    assert _run(sc, 3) == [0.0, 50.0, 25.0]  # after a restart: everything since it
    only_slots = _Replay([(None, _slot(1, 10)), (None, _slot(1, 30)), (None, _slot(2, 7))])
    assert _run(only_slots, 3) == [0.0, 20.0, 7.0]
