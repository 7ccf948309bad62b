"""What operators see of the daemon (issue 15, items 6-8): a Grafana dashboard that works with any
scrape interval and keeps units apart, metric names by the Prometheus conventions with build info,
untagged traffic stated one way, and log lines that journald does not stamp twice."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from powerprof import __version__
from powerprof.daemon import service
from powerprof.daemon.metrics import GpuSnapshot, Snapshot, TagLimiter, make_registry, render
from powerprof.profiler import NO_COUNTER_SHORT_FLAG
from powerprof.storage.schema import CACHE_LATE_FLAG

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "systemd" / "grafana-powerprof.json"

# What each exported series measures once a query has turned it into a plotted value.
_UNIT_OF = [
    (r"rate\(powerprof_(gpu|cpu)_energy_joules_total|powerprof_gpu_(interval|attributed)_energy_joules_total"
     r"|powerprof_gpu_energy_attributed_joules_total", "W"),
    (r"powerprof_gpu_power(_limit)?_watts|powerprof_idle_power_watts", "W"),
    (r"powerprof_(requests_energy|attributed_tokens|work_prefill_per_decode)_ratio|powerprof_work_model_(r_squared|fitted)", "ratio"),
    (r"powerprof_work_cost_joules", "J"),
    (r"rate\(powerprof_gpu_energy_unknown_seconds_total", "ratio"),  # seconds unread per second: a share of the time
    (r"powerprof_joules_per_token", "J/token"),
    (r"powerprof_tokens_generated_total", "tokens/s"),
    (r"powerprof_requests_total|powerprof_requests_no_counter_short_total|powerprof_requests_cache_late_total", "requests/s"),
    (r"_hertz", "Hz"),
    (r"process_cpu_seconds_total", "cores"),
    (r"_bytes", "bytes"),
    (r"powerprof_(dropped_rows|flush_errors|proxy_recorder_failures|proxy_upstream_failures)_total", "events/s"),
]


# A snapshot with the work model fitted: every attribution metric is exported.
_WORK_MODEL = dict(energy_by_dest_j=(80.0, 15.0, 5.0), tokens_closed=100.0, tokens_attributed=100.0,
                   work_costs={"source": "fitted", "idle_w": 60.0, "step_j": 0.9, "decode_j": 0.2,
                               "prefill_per_decode": 0.04, "r2": 0.99, "rel_rmse": 0.03})


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _unit(expr: str) -> str:
    for pattern, unit in _UNIT_OF:
        if re.search(pattern, expr):
            return unit
    raise AssertionError(f"no unit known for {expr}")


def _exposition(**snap) -> dict:
    holder = type("H", (), {})()
    holder.snapshot = Snapshot(**snap)
    text = render(make_registry(holder)).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


# --- item 6: Grafana ---------------------------------------------------------------------------


def test_every_range_uses_rate_interval():
    exprs = [t["expr"] for p in _dashboard()["panels"] for t in p["targets"]]
    ranges = [r for e in exprs for r in re.findall(r"\[([^\]]+)\]", e)]
    assert ranges and set(ranges) == {"$__rate_interval"}


def test_no_panel_mixes_units():
    for p in _dashboard()["panels"]:
        units = {_unit(t["expr"]) for t in p["targets"]}
        assert len(units) == 1, (p["title"], units)
        assert p["fieldConfig"]["defaults"].get("unit"), p["title"]


def test_health_panel_and_host_variable():
    d = _dashboard()
    exprs = " ".join(t["expr"] for p in d["panels"] for t in p["targets"])
    for m in ("powerprof_dropped_rows_total", "powerprof_flush_errors_total", "powerprof_proxy_recorder_failures_total",
              "powerprof_proxy_upstream_failures_total"):
        assert m in exprs, m
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert "host" in variables and "powerprof_build_info" in variables["host"]["query"]
    assert "$host" in variables["instance"]["query"]


def test_dashboard_queries_only_exported_metrics():
    names = set(_exposition(gpus=(GpuSnapshot(0, "GPU-x", "gpu", 100.0, 1.0, 1.0, 300.0, 5.0),), cpu_energy_j=1.0,
                            joules_per_token=0.5, tokens_by_tag={"a": 1}, requests_by_tag={("a", "ok"): 1},
                            **_WORK_MODEL))
    exported = {n + "_total" for n in names} | names
    used = {m for p in _dashboard()["panels"] for t in p["targets"]
            for m in re.findall(r"(?:powerprof|process)_[a-z_]+", t["expr"])}
    assert used <= exported, used - exported


# --- item 7: Prometheus ------------------------------------------------------------------------


def test_metric_names_carry_no_label_names_and_the_docs_list_them_all():
    fams = _exposition(gpus=(GpuSnapshot(0, "GPU-x", "gpu", 100.0, 1.0, 1.0, 300.0, 5.0),), cpu_energy_j=1.0,
                       joules_per_token=0.5, server_tokens=3.0, tokens_by_tag={"a": 1},
                       requests_by_tag={("a", "ok"): 1}, **_WORK_MODEL)
    docs = (ROOT / "docs" / "daemon.md").read_text()
    for name, f in fams.items():
        if not name.startswith("powerprof_"):
            continue
        assert "_by_" not in name, name
        shown = name + "_total" if f.type == "counter" else name
        assert shown in docs, shown
    assert "powerprof_gpu_interval_energy_joules" in fams
    assert "| `powerprof_gpu_energy_by_kind" not in docs  # named only as the old name


def test_build_info():
    (s,) = _exposition()["powerprof_build_info"].samples
    assert s.value == 1 and s.labels["version"] == __version__ and s.labels["host"] and s.labels["python"]


def test_untagged_traffic_has_no_tag_label_as_parquet_has_null():
    limiter = TagLimiter()
    assert limiter.label(None) == "" and limiter.label("") == ""
    assert limiter.label("none") == "none"  # a client's own tag named "none" is not confused with no tag
    fams = _exposition(tokens_by_tag={limiter.label(None): 7.0, "a": 2.0})
    by_tag = {s.labels.get("tag", ""): s.value for s in fams["powerprof_tokens_generated"].samples
              if s.name.endswith("_total")}
    assert by_tag == {"": 7.0, "a": 2.0}  # tag="" is the same series as no tag label in Prometheus


# --- item 8: log lines under journald ----------------------------------------------------------


def test_journald_gets_no_timestamps_a_terminal_does(tmp_path):
    import os

    with open(tmp_path / "stream", "w") as f:
        st = os.fstat(f.fileno())
        journal = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert service.under_journald(journal, f.fileno())
        assert service.log_format(journal, f.fileno()) == service.JOURNAL_LOG_FORMAT
        # Inherited by a process whose stderr went elsewhere: not the journal.
        assert not service.under_journald({"JOURNAL_STREAM": "1:2"}, f.fileno())
        assert service.log_format({}, f.fileno()) == service.TERMINAL_LOG_FORMAT
    rec = logging.LogRecord("powerprof.daemon", logging.INFO, __file__, 1, "started", None, None)
    journal_line = logging.Formatter(service.JOURNAL_LOG_FORMAT).format(rec)
    terminal_line = logging.Formatter(service.TERMINAL_LOG_FORMAT).format(rec)
    assert journal_line == "INFO powerprof.daemon: started"
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", terminal_line)


def test_requests_flagged_no_counter_short_are_counted_on_metrics():
    # Short requests on a GPU without an energy counter (ledger: energy_note no-counter-short) are said on /metrics,
    # and at zero too: a dashboard tells "none" from "not exported".
    fams = _exposition(flagged_requests={NO_COUNTER_SHORT_FLAG: 3})
    (sample,) = fams["powerprof_requests_no_counter_short"].samples
    assert sample.value == 3
    assert "no-counter-short" in fams["powerprof_requests_no_counter_short"].documentation
    (zero,) = _exposition()["powerprof_requests_no_counter_short"].samples
    assert zero.value == 0


def test_the_j_per_token_help_says_what_it_leaves_out_and_the_flag_count_says_the_fix():
    # A user reading /metrics sees the headline J/token leave out no-counter-short intervals (its HELP said "recent
    # decode intervals" only) and, beside the count of such requests, what to do about them.
    fams = _exposition(flagged_requests={NO_COUNTER_SHORT_FLAG: 1}, joules_per_token=0.5)
    assert "no-counter-short" in fams["powerprof_joules_per_token"].documentation
    assert "jpt_window_s" in fams["powerprof_joules_per_token"].documentation
    doc = fams["powerprof_requests_no_counter_short"].documentation
    assert "fix: a GPU with an energy counter" in doc and "instant power" in doc


def test_the_dashboard_shows_the_requests_left_out_of_its_j_per_token():
    # The J/token panel leaves no-counter-short intervals out (the daemon's headline does): the dashboard says so and
    # plots how many requests were left out, so a falling count of requests behind the figure is seen.
    panels = _dashboard()["panels"]
    (jpt,) = [p for p in panels if any("powerprof_joules_per_token" in t["expr"] for t in p["targets"])]
    assert "no-counter-short" in jpt["description"]
    (left,) = [p for p in panels if any("powerprof_requests_no_counter_short_total" in t["expr"] for t in p["targets"])]
    assert "no-counter-short" in left["title"] and "Fix:" in left["description"]


def test_requests_flagged_prefix_cache_late_are_counted_on_metrics():
    # Rows saying prefix-cache-late (a cached count said at a stream's end, or a share beside one) are counted, at
    # zero too, with the fix in the HELP. Before: no such series (prefix-cache-unsaid had one).
    fams = _exposition(flagged_requests={CACHE_LATE_FLAG: 4})
    (sample,) = fams["powerprof_requests_cache_late"].samples
    assert sample.value == 4 and sample.name == "powerprof_requests_cache_late_total"
    assert "prefix-cache-late" in fams["powerprof_requests_cache_late"].documentation
    assert "fix: ask without continuous usage" in fams["powerprof_requests_cache_late"].documentation
    (zero,) = _exposition()["powerprof_requests_cache_late"].samples
    assert zero.value == 0


def test_bodies_streamed_on_uninspected_over_the_budget_are_counted_on_metrics():
    # The proxy counted request bodies it streamed on uninspected for the inspection budget (uninspected_bodies: their
    # rows' model and stream unknown, their prompt unread) and /metrics never said it: a budget full for hours showed
    # only on the rows. Now a counter, at zero too.
    fams = _exposition(proxy_uninspected_bodies=3)
    (sample,) = fams["powerprof_proxy_uninspected_bodies"].samples
    assert sample.value == 3 and sample.name == "powerprof_proxy_uninspected_bodies_total"
    assert "budget" in fams["powerprof_proxy_uninspected_bodies"].documentation
    (zero,) = _exposition()["powerprof_proxy_uninspected_bodies"].samples
    assert zero.value == 0


def test_the_proxys_body_reader_failures_are_counted_on_metrics():
    # The proxy counted its own faults reading a request body (Proxy.proxy_failures: a bug, each one's body streamed on
    # unread or answered 500) and /metrics never said it: only the log's first five and every 1000th. Now a counter,
    # at zero too.
    fams = _exposition(proxy_body_reader_failures=2)
    (sample,) = fams["powerprof_proxy_body_reader_failures"].samples
    assert sample.value == 2 and sample.name == "powerprof_proxy_body_reader_failures_total"
    assert "bug" in fams["powerprof_proxy_body_reader_failures"].documentation
    (zero,) = _exposition()["powerprof_proxy_body_reader_failures"].samples
    assert zero.value == 0


def test_a_body_reader_failure_is_read_from_a_running_daemons_metrics(tmp_path, monkeypatch):
    # End to end: the in-process proxy's reader fails on one request body (a fault injected in aiohttp's stream, as
    # test_daemon_proxy's reader-bug tests do); the request streams on, and the daemon's /metrics says 1.
    import asyncio
    import urllib.request

    import aiohttp
    import aiohttp.streams
    from aiohttp import web

    from powerprof.daemon.config import load_config
    from powerprof.rig import Rig
    from powerprof.sim.nvml import SimNVML

    orig = aiohttp.streams.StreamReader.read_nowait

    def broken(self, n=-1):  # the proxy's read of a small body already whole; nothing else here calls it
        raise ValueError("reader bug")

    async def ok(_request):
        return web.json_response({"content": "hi", "tokens_predicted": 1})

    def scrape(url):
        text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        return {f.name: f for f in text_string_to_metric_families(text)}

    async def main():
        up = web.Application()
        up.router.add_route("*", "/{tail:.*}", ok)
        runner = web.AppRunner(up)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        cfg = load_config(None, env={}, overrides={
            "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 0.1, "daemon.flush_interval_s": 0.1,
            "proxy.listen": "127.0.0.1:0", "proxy.upstream": f"http://127.0.0.1:{port}",
            "metrics.listen": "127.0.0.1:0", "daemon.restore_on_start": False, "scrape.server": "none"})
        d = service.Daemon(cfg, Rig("a100-40g", nvml=SimNVML("a100-40g", state_path=None)))
        task = asyncio.create_task(d.run())
        try:
            for _ in range(400):
                if "proxy" in d.urls and "metrics" in d.urls:
                    break
                await asyncio.sleep(0.05)
            before = await asyncio.to_thread(scrape, d.urls["metrics"])
            monkeypatch.setattr(aiohttp.streams.StreamReader, "read_nowait", broken)
            async with aiohttp.ClientSession() as s:
                async with s.post(d.urls["proxy"] + "/completion", json={"prompt": "x", "n_predict": 1}) as r:
                    status = r.status
                    await r.read()
            monkeypatch.setattr(aiohttp.streams.StreamReader, "read_nowait", orig)
            for _ in range(100):  # the snapshot /metrics serves is taken on the daemon's ticks (interval_s)
                after = await asyncio.to_thread(scrape, d.urls["metrics"])
                if after["powerprof_proxy_body_reader_failures"].samples[0].value:
                    break
                await asyncio.sleep(0.1)
        finally:
            monkeypatch.setattr(aiohttp.streams.StreamReader, "read_nowait", orig)
            d.stop_event.set()
            rc = await task
            await runner.cleanup()
        return status, before, after, rc

    status, before, after, rc = asyncio.run(asyncio.wait_for(main(), 120))
    assert status == 200 and rc == 0
    assert before["powerprof_proxy_body_reader_failures"].samples[0].value == 0
    assert after["powerprof_proxy_body_reader_failures"].samples[0].value == 1


def test_the_power_panel_from_energy_counters_leaves_out_an_instance_with_a_gpu_unread_over_the_range():
    # A rate() over a range overlapping a GPU's unread time reads low whether its series is absent or not (Prometheus
    # extrapolates the increase between the range's first and last samples): before, the panel summed every instance's
    # rate, a 60 s gap of a 300 W GPU reading 237 W for 5 minutes; and the share panel's max of 1 clipped the share
    # above 1 that a range shorter than the accounts' batches reads.
    panels = {p["title"]: p for p in _dashboard()["panels"]}
    (gpu,) = [t["expr"] for t in panels["GPU + CPU power from energy counters"]["targets"]
              if "powerprof_gpu_energy_joules_total" in t["expr"]]
    kept, _, dropped = gpu.partition(" unless on (job, instance) ")
    assert kept.startswith("sum by (job, instance) (rate(powerprof_gpu_energy_joules_total"), gpu
    assert "rate(powerprof_gpu_energy_unknown_seconds_total" in dropped and dropped.rstrip(")").endswith("> 0"), gpu
    share = panels["GPUs without an energy reading (share of the time)"]["fieldConfig"]["defaults"]
    assert "max" not in share


def test_the_energy_help_says_a_rate_over_an_unread_gap_reads_low():
    # Before: the help said the series is absent while unread, as if that kept a rate() right.
    fams = _exposition(gpus=(GpuSnapshot(0, "GPU-x", "gpu", 100.0, 1.0, 1.0, 300.0, 5.0),))
    assert "reads low" in fams["powerprof_gpu_energy_joules"].documentation
    assert "exceed 1" in fams["powerprof_gpu_energy_unknown_seconds"].documentation


def test_panels_of_energy_counters_leave_out_instances_with_a_gpu_unread():
    # The by-kind and by-destination counters leave an interval whose energy is unknown (a GPU unread) out, as the
    # per-GPU counter leaves the unread time out: a rate() over a range holding it read low, unsaid (the "GPU power by
    # interval kind" panel dipped 20% over a 60 s gap in 5 minutes on one 300 W GPU). Each such panel plots per
    # instance (a sum across instances would dip as silently when one is left out) and leaves out an instance whose
    # unread seconds rose over the range, as the power panel does, and says so.
    leave_out = ("unless on (job, instance) (sum by (job, instance) (rate(powerprof_gpu_energy_unknown_seconds_total"
                 "{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval])) > 0)")
    counters = ("powerprof_gpu_energy_joules_total", "powerprof_gpu_interval_energy_joules_total",
                "powerprof_gpu_energy_attributed_joules_total")
    seen = set()
    for p in _dashboard()["panels"]:
        for t in p["targets"]:
            for c in counters:
                if f"rate({c}" in t["expr"]:
                    seen.add(c)
                    assert t["expr"].endswith(leave_out), (p["title"], t["expr"])
                    assert re.match(r"sum by \(job, instance(, \w+)?\) \(rate\(", t["expr"]), (p["title"], t["expr"])
                    assert "{{instance}}" in t["legendFormat"], p["title"]
                    assert "left out" in p["description"] and "powerprof_gpu_energy_unknown_seconds_total" in \
                        p["description"], p["title"]
    assert seen == set(counters)
