"""Parsing the servers' own token counters."""

from __future__ import annotations

from powerprof.daemon.scrape import counter_total, slot_progress, slots_delta

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
