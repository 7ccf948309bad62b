"""A server started with `--api-key` (llama-server, vLLM): powerprof sends $POWERPROF_API_KEY, and says what is wrong
where it is missing or refused, instead of "neither llama.cpp nor OpenAI-compatible" or "start it with --metrics"."""

from __future__ import annotations

import asyncio

import pytest

from powerprof.daemon.scrape import Scraper, new_session as scrape_session
from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer
from powerprof.workload.client import RequestParams, ServerUnreachable, detect_server, new_session, send_request


@pytest.mark.parametrize("flavour", ["llamacpp", "vllm", "sglang"])
def test_runs_send_the_key_and_say_when_it_is_missing_or_refused(flavour, monkeypatch):
    # Session 46's walkthrough against llama-server --api-key: "answers but is neither llama.cpp (/props) nor
    # OpenAI-compatible (/v1/models): pass --api", and powerprof had no way to give a key.
    async def run():
        async with new_session() as s:
            info = await detect_server(s, srv.url)
            return info, await send_request(s, info, "hello there", RequestParams(max_tokens=8))

    with SimServer(SimNVML("seed-16g", state_path=None), flavour=flavour, api_key="sekrit", draft_n_max=0) as srv:
        monkeypatch.delenv("POWERPROF_API_KEY", raising=False)
        with pytest.raises(ServerUnreachable, match="401 Unauthorized: it was started with an API key") as e:
            asyncio.run(run())
        assert "none was given" in str(e.value) and "set POWERPROF_API_KEY=" in str(e.value)
        monkeypatch.setenv("POWERPROF_API_KEY", "wrong")
        with pytest.raises(ServerUnreachable, match="refuses the one in \\$POWERPROF_API_KEY"):
            asyncio.run(run())
        monkeypatch.setenv("POWERPROF_API_KEY", "sekrit")
        info, rec = asyncio.run(run())
    assert info.kind == flavour
    assert rec.status == "ok" and rec.generated_tokens == 8, (rec.status, rec.error)


def test_the_daemons_scraper_names_the_missing_key_not_a_missing_flag(monkeypatch):
    # llama-server --api-key guards /metrics and /slots: the daemon said "start it with --metrics" of a server that
    # had it, and counted no bypass traffic, unsaid why.
    async def detect():
        async with scrape_session() as s:
            sc = Scraper(s, srv.url)
            return await sc._detect(), sc.last_error

    with SimServer(SimNVML("seed-16g", state_path=None), flavour="llamacpp", api_key="sekrit", draft_n_max=0) as srv:
        monkeypatch.delenv("POWERPROF_API_KEY", raising=False)
        kind, why = asyncio.run(detect())
        assert kind is None and "401 Unauthorized" in why and "set POWERPROF_API_KEY in the daemon's environment" in why
        monkeypatch.setenv("POWERPROF_API_KEY", "sekrit")
        assert asyncio.run(detect())[0] == "llamacpp"
