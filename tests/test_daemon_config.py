"""Daemon config: file, environment and flags; bad input rejected naming the key."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from powerprof.daemon.config import SPEC, ConfigError, example_toml, load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path, text):
    p = tmp_path / "powerprof.toml"
    p.write_text(text)
    return p


def test_precedence_file_then_environment_then_flags(tmp_path):
    p = _write(tmp_path, '[proxy]\nupstream = "http://127.0.0.1:8080"\nlisten = "127.0.0.1:9000"\n[daemon]\ninterval_s = 2\n')
    env = {"POWERPROF_PROXY_LISTEN": "127.0.0.1:9001", "POWERPROF_DAEMON_GPUS": "0,2", "POWERPROF_SIM_STATE": "x"}
    cfg = load_config(p, env=env, overrides={"proxy.listen": "127.0.0.1:9002", "daemon.data_dir": None})
    assert cfg.get("proxy", "upstream") == "http://127.0.0.1:8080"
    assert cfg.get("proxy", "listen") == "127.0.0.1:9002"
    assert cfg.get("daemon", "interval_s") == 2.0
    assert cfg.get("daemon", "gpus") == [0, 2]
    assert load_config(p, env=env).get("proxy", "listen") == "127.0.0.1:9001"


@pytest.mark.parametrize(
    "text, key",
    [
        ("[proxy]\nupstrem = 'http://x'\n", "proxy.upstrem"),
        ("[daemon]\ninterval_s = 0\n", "daemon.interval_s"),
        ("[daemon]\ninterval_s = 'fast'\n", "daemon.interval_s"),
        ("[proxy]\nupstream = 'ftp://host'\n", "proxy.upstream"),
        ("[metrics]\nlisten = '127.0.0.1'\n", "metrics.listen"),
        ("[scrape]\nserver = 'tgi'\n", "scrape.server"),
        ("[daemon]\ngpus = [-1]\n", "daemon.gpus"),
        ("[daemon]\nrestore_on_start = 1\n", "daemon.restore_on_start"),
        ("[proxy]\ntag_header = 'X Tag'\n", "proxy.tag_header"),
        ("[proxy]\nbody_min_bytes_per_s = -1\n", "proxy.body_min_bytes_per_s"),
        ("[proxy]\nbody_min_bytes_per_s = 'fast'\n", "proxy.body_min_bytes_per_s"),
        ("[sampler]\nx = 1\n", "[sampler]"),
    ],
)
def test_bad_values_and_unknown_keys_are_rejected_naming_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, text), env={})
    assert key in str(e.value)


def test_bad_environment_values_name_the_key():
    with pytest.raises(ConfigError, match="daemon.flush_interval_s"):
        load_config(None, env={"POWERPROF_DAEMON_FLUSH_INTERVAL_S": "soon"})
    with pytest.raises(ConfigError, match="proxy.colour.*POWERPROF_PROXY_COLOUR"):
        load_config(None, env={"POWERPROF_PROXY_COLOUR": "red"})


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("POWERPROF_DAEMON_INTERVAL_S", "soon", "must be a number (e.g. 1.5)"),
        ("POWERPROF_DAEMON_INTERVAL_S", "100", "must be >= 0.02 and <= 10.0"),
        ("POWERPROF_PROXY_WORKERS", "2.5", "must be a whole number (e.g. 4)"),
        ("POWERPROF_PROXY_WORKERS", "99", "must be >= 1 and <= 64"),
        ("POWERPROF_DAEMON_RESTORE_ON_START", "maybe", "must be true or false"),
        ("POWERPROF_DAEMON_GPUS", "0,x", "must be a list of GPU indexes"),
        ("POWERPROF_PROXY_UPSTREAM", "ftp://host", "expected an http:// or https:// URL"),
    ],
)
def test_bad_environment_values_name_the_variable_its_text_and_what_is_expected(name, text, expected):
    # The message named only the key and Python's own words ("could not convert string to float: 'soon'"),
    # so whoever set the variable in a systemd drop-in had to guess which one was meant.
    with pytest.raises(ConfigError) as e:
        load_config(None, env={name: text})
    msg = str(e.value)
    assert f"environment variable {name}={text!r}" in msg and expected in msg, msg
    assert "could not convert" not in msg and "invalid literal" not in msg


def test_a_numeric_tag_label_from_the_environment_is_the_text_it_reads():
    # "2024" (or "7,beta") in POWERPROF_METRICS_TAGS was read as the number 2024 and refused as
    # "must be a list of non-empty strings": a list's parts are parsed by the key's element type.
    assert load_config(None, env={"POWERPROF_METRICS_TAGS": "2024"}).get("metrics", "tags") == ["2024"]
    assert load_config(None, env={"POWERPROF_METRICS_TAGS": "7, beta"}).get("metrics", "tags") == ["7", "beta"]
    assert load_config(None, env={"POWERPROF_DAEMON_GPUS": "0,2"}).get("daemon", "gpus") == [0, 2]
    assert all(k.item in (int, str) for keys in SPEC.values() for k in keys.values() if k.type is list)


def test_a_bad_environment_variable_stops_the_daemon_naming_it(tmp_path):
    from click.testing import CliRunner

    from powerprof.cli import main

    r = CliRunner().invoke(main, ["daemon", "--simulate", "--data-dir", str(tmp_path / "d")],
                           env={"POWERPROF_DAEMON_INTERVAL_S": "fast"})
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit)
    assert "POWERPROF_DAEMON_INTERVAL_S='fast'" in r.output and "must be a number" in r.output
    assert not (tmp_path / "d").exists()  # nothing started, nothing written


def test_checks_across_keys_name_the_variable_a_value_came_from():
    with pytest.raises(ConfigError, match="from environment variable POWERPROF_PROXY_LISTEN"):
        load_config(None, env={"POWERPROF_PROXY_LISTEN": "0.0.0.0:8081"})


def test_bad_file_values_name_the_file(tmp_path):
    p = _write(tmp_path, "[daemon]\ninterval_s = 100\n")
    with pytest.raises(ConfigError, match=f"config key daemon.interval_s = 100.0 in {p}: must be >= 0.02"):
        load_config(p, env={})


def test_missing_or_broken_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_write(tmp_path, "[proxy\n"), env={})


def test_shipped_example_configs_load_and_cover_every_key(tmp_path):
    generated = tomllib.loads(example_toml())
    assert {s: set(k) for s, k in generated.items()} == {s: set(k) for s, k in SPEC.items()}
    load_config(_write(tmp_path, example_toml()), env={})
    shipped = ROOT / "systemd" / "powerprof.toml"
    cfg = load_config(shipped, env={})
    assert cfg.get("metrics", "listen").startswith("127.0.0.1:")


def test_reload_separates_live_changes_from_restart_ones(tmp_path):
    a = load_config(None, env={})
    b = load_config(None, env={}, overrides={"daemon.flush_interval_s": 5.0, "proxy.listen": "127.0.0.1:1"})
    live, restart = a.reload_changes(b)
    assert live == {"daemon.flush_interval_s": 5.0}
    assert restart == ["proxy.listen"]


@pytest.mark.skipif(os.geteuid() != 0,
                    reason="the rule is root's: an unprivileged daemon reads any config its user can")
def test_root_uses_no_config_file_another_user_could_write(tmp_path):
    # Before: root followed a config anyone could write: its tags.socket could name any socket on the
    # machine (a stale one there is replaced) and its data_dir any folder.
    good = tmp_path / "ok.toml"
    good.write_text("[daemon]\ninterval_s = 1.0\n")
    good.chmod(0o644)
    load_config(good, env={})
    shared = tmp_path / "shared.toml"
    shared.write_text("[tags]\nsocket = '/run/other.sock'\n")
    shared.chmod(0o666)
    with pytest.raises(ConfigError, match="not using config file .* as root: .*writable by group or others"):
        load_config(shared, env={})
    link = tmp_path / "link.toml"
    link.symlink_to(good)
    os.lchown(link, 65534, 65534)  # a link another user owns: they could point it anywhere
    with pytest.raises(ConfigError, match="as root: .*symlink .* is owned by uid 65534"):
        load_config(link, env={})


@pytest.mark.skipif(os.geteuid() != 0,
                    reason="the rule is root's: an unprivileged daemon reads any config its user can")
def test_root_follows_a_config_symlink_only_root_could_have_made_as_on_nixos(tmp_path):
    # Before: root refused any symlinked config, and NixOS's /etc/powerprof/config.toml is one: a chain of
    # root-owned links into /nix/store (root-owned, read-only, a sticky folder).
    store = tmp_path / "nix" / "store"
    (store / "abc-etc" / "powerprof").mkdir(parents=True)
    store.chmod(0o1775)  # /nix/store: root:nixbld rwxrwxr-t
    real = store / "abc-etc" / "powerprof" / "config.toml"
    real.write_text("[daemon]\ninterval_s = 2.0\n")
    real.chmod(0o444)
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "static").symlink_to(store / "abc-etc")  # /etc/static -> /nix/store/…-etc
    (etc / "powerprof").mkdir()
    conf = etc / "powerprof" / "config.toml"
    conf.symlink_to("../static/powerprof/config.toml")  # relative, through another link
    assert load_config(conf, env={}).get("daemon", "interval_s") == 2.0
    # Anything on the way another user could have written is still refused:
    os.lchown(etc / "static", 65534, 65534)
    with pytest.raises(ConfigError, match="symlink .*static on its way is owned by uid 65534"):
        load_config(conf, env={})
    os.lchown(etc / "static", 0, 0)
    (store / "abc-etc").chmod(0o777)  # a folder on the resolved path that others can write
    with pytest.raises(ConfigError, match="abc-etc is writable by group or others"):
        load_config(conf, env={})
    (store / "abc-etc").chmod(0o755)
    os.chown(real, 65534, 65534)  # the target file itself
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        load_config(conf, env={})
    os.chown(real, 0, 0)
    loop = etc / "loop.toml"
    loop.symlink_to(loop)
    with pytest.raises(ConfigError, match="too many levels of symlinks"):
        load_config(loop, env={})


def test_daemon_gpus_takes_uuids_as_gpus_does_and_refuses_what_names_no_gpu(tmp_path):
    # daemon.gpus took NVML indexes only, which move across reboots, driver reloads and CUDA orderings: a
    # daemon configured for "1" could sample (and attribute the energy of) another GPU after a reboot.
    p = _write(tmp_path, '[daemon]\ngpus = ["GPU-8f2e", "MIG-1a2b3c", 1]\n')
    assert load_config(p, env={}).get("daemon", "gpus") == ["GPU-8f2e", "MIG-1a2b3c", 1]
    env = {"POWERPROF_DAEMON_GPUS": "GPU-8f2e-aa,0"}
    assert load_config(None, env=env).get("daemon", "gpus") == ["GPU-8f2e-aa", 0]
    for bad in ('["8f2e"]', '["GPU-"]', '[true]', '["GPU-a b"]'):
        with pytest.raises(ConfigError, match="daemon.gpus.*UUIDs"):
            load_config(_write(tmp_path, f"[daemon]\ngpus = {bad}\n"), env={})


def test_the_daemon_samples_the_gpu_its_uuid_names_and_stops_naming_one_that_is_not_there(tmp_path):
    from powerprof.daemon.service import Daemon, StartupError
    from powerprof.rig import Rig
    from powerprof.sim.nvml import SimNVML

    sim = SimNVML("a100-40g", count=2, state_path=None)
    uuid = sim.gpus[1].uuid

    def daemon(gpus):
        cfg = load_config(None, env={}, overrides={
            "daemon.data_dir": str(tmp_path / "data"), "daemon.gpus": gpus, "proxy.listen": "", "metrics.listen": "",
            "daemon.restore_on_start": False})
        return Daemon(cfg, Rig("a100-40g", gpus=cfg.get("daemon", "gpus") or None, nvml=sim))

    d = daemon([uuid[:12]])
    try:
        d._open()
        assert d.collector.indexes == [1] and d.collector.infos[0].uuid == uuid
    finally:
        d.rig.close()
        if getattr(d, "_lock_fd", None) is not None:
            import os

            os.close(d._lock_fd)
    import threading

    before = set(threading.enumerate())
    with pytest.raises(StartupError, match="GPU-00000000.*names no GPU"):
        daemon(["GPU-00000000"])._open()
    # The refused start leaves no simulated powercap updater behind (it did: the thread outlived the test).
    assert not [t.name for t in threading.enumerate() if t.name.startswith("powerprof-sim-") and t not in before]



def test_daemon_serving_gpus_names_sampled_gpus_or_is_refused_at_load_check_and_start(tmp_path):
    # daemon.serving_gpus asserts which sampled GPUs the proxied server runs on (one the daemon cannot see: a
    # container, another pid namespace). One naming no GPU, or a GPU daemon.gpus does not sample, is refused: at load
    # (and so `daemon --check`) where the config alone tells, else at start, naming the key. Before: an unknown key.
    from click.testing import CliRunner

    from powerprof.cli import main
    from powerprof.daemon.service import Daemon, StartupError
    from powerprof.rig import Rig
    from powerprof.sim.nvml import SimNVML

    assert load_config(_write(tmp_path, '[daemon]\nserving_gpus = [1, "GPU-8f2e"]\n'), env={}).get(
        "daemon", "serving_gpus") == [1, "GPU-8f2e"]
    assert load_config(None, env={}).get("daemon", "serving_gpus") == []
    for bad, said in (('gpus = [0, 1]\nserving_gpus = [2]', "2 is not in daemon.gpus"),
                      ('gpus = ["GPU-aa"]\nserving_gpus = ["GPU-bb"]', "'GPU-bb' is not in daemon.gpus"),
                      ('serving_gpus = ["8f2e"]', "daemon.serving_gpus.*UUIDs")):
        p = _write(tmp_path, f"[daemon]\n{bad}\n")
        with pytest.raises(ConfigError, match=said):
            load_config(p, env={})
        r = CliRunner().invoke(main, ["daemon", "--check", "--config", str(p)])
        assert r.exit_code == 2 and "daemon.serving_gpus" in r.output and "config OK" not in r.output, r.output
    # A simulated host's count given (--sim-gpus), an index past it is refused by --check as daemon.gpus's is.
    r = CliRunner().invoke(main, ["daemon", "--check", "--simulate", "a100-40g", "--sim-gpus", "2", "--config",
                                  str(_write(tmp_path, "[daemon]\nserving_gpus = [2]\n"))])
    assert r.exit_code == 2 and "daemon.serving_gpus: GPU index 2 does not exist" in r.output, r.output
    # None given, the host the start makes (daemon.gpus's indexes, else one GPU; a mixed profile's count): [5] passed
    # --check ("config OK", rc 0), then the start refused it (exit 1; a review's repro). Within it, still OK.
    for simulate, keys, ok in (("a100-40g", "serving_gpus = [5]", False),
                               ("a100-40g", "gpus = [0, 1]\nserving_gpus = [1]", True),
                               ("a100-40g,a100-40g", "serving_gpus = [1]", True),
                               ("a100-40g,a100-40g", "serving_gpus = [2]", False)):
        r = CliRunner().invoke(main, ["daemon", "--check", "--simulate", simulate, "--config",
                                      str(_write(tmp_path, f"[daemon]\n{keys}\n"))])
        assert (r.exit_code == 0 and "config OK" in r.output) if ok else (
            r.exit_code == 2 and "daemon.serving_gpus: GPU index" in r.output), (simulate, keys, r.output)
    sim = SimNVML("a100-40g", count=2, state_path=None)

    def daemon(gpus, serving):
        cfg = load_config(None, env={}, overrides={
            "daemon.data_dir": str(tmp_path / "data"), "daemon.gpus": gpus, "daemon.serving_gpus": serving,
            "proxy.listen": "", "metrics.listen": "", "daemon.restore_on_start": False})
        return Daemon(cfg, Rig("a100-40g", gpus=cfg.get("daemon", "gpus") or None, nvml=sim))

    for gpus, serving, said in (([], ["GPU-00000000"], "'GPU-00000000' names no GPU"),
                                ([sim.gpus[0].uuid], [1], "GPU 1 is not sampled")):
        with pytest.raises(StartupError, match=f"daemon.serving_gpus.*{said}"):
            daemon(gpus, serving)._open()
    # Told at once, as asserted. The simulated server runs on both GPUs, its processes seen: an assertion of GPU 1
    # alone is told provisional (the rows flagged until the GPUs' power judges the same), one of both is taken.
    for serving, mask_said, doubted in (([sim.gpus[1].uuid[:12]], [False, True], True),
                                        ([0, sim.gpus[1].uuid], [True, True], False)):
        d = daemon([], serving)
        try:
            d._open()
            mask, source, provisional = d.ledger._told_serving
            assert mask.tolist() == mask_said and source == "daemon.serving_gpus" and provisional == doubted
        finally:
            d.rig.close()
            os.close(d._lock_fd)


def _sim_left(parent) -> tuple[list, list]:
    """The simulated powercap updater threads and trees (under `parent`) there are."""
    import threading

    from powerprof.sim.powercap import SIM_POWERCAP_PREFIX

    return ([t.name for t in threading.enumerate() if t.name.startswith("powerprof-sim-")],
            sorted(p.name for p in Path(parent).glob(SIM_POWERCAP_PREFIX + "*")))


def test_a_daemon_start_refused_by_an_os_error_after_its_sources_says_so_and_leaves_no_simulated_tree(
        tmp_path, monkeypatch):
    # Daemon._open closed the rig for ValueError and lock_data_dir's OSError alone: an OSError after rig.sources (here
    # the datasets' folder out of space) came out as itself, a traceback, with the powerprof-sim-powercap thread
    # writing on and its folder left.
    import errno

    from powerprof.daemon import service
    from powerprof.daemon.service import Daemon, StartupError
    from powerprof.rig import Rig

    state = tmp_path / "state"
    monkeypatch.setenv("POWERPROF_STATE_DIR", str(state))
    before = _sim_left(state)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "data"))

    monkeypatch.setattr(service, "DatasetStore", full)
    cfg = load_config(None, env={}, overrides={"daemon.data_dir": str(tmp_path / "data"), "proxy.listen": "",
                                               "metrics.listen": "", "daemon.restore_on_start": False})
    d = Daemon(cfg, Rig("seed-16g"))
    with pytest.raises(StartupError, match="cannot start: OSError: .Errno 28. No space left on device: .*data"):
        d._open()
    if d._lock_fd is not None:
        os.close(d._lock_fd)
    assert _sim_left(state) == before


def test_a_daemon_whose_state_folder_is_a_file_says_so_without_a_traceback(tmp_path):
    # Before: exit 1 with a NotADirectoryError traceback from the simulated powercap tree's folder (every other command
    # said it in a line, through _open_rig_or_exit).
    import subprocess

    from daemon_helpers import sim_env

    state = tmp_path / "state-file"
    state.write_text("x")
    p = subprocess.run([sys.executable, "-m", "powerprof", "daemon", "--simulate", "--data-dir", str(tmp_path / "data"),
                        "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--tag-socket",
                        str(tmp_path / "t.sock")], env={**os.environ, **sim_env(tmp_path),
                                                         "POWERPROF_STATE_DIR": str(state)},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert f"state folder {state} is a file, not a folder. Fix:" in p.stderr and "Traceback" not in p.stderr, p.stderr

@pytest.mark.parametrize(
    "listen, said",
    [
        ("999.1.1.1:80", "999.1.1.1 is not a valid IPv4 address"),
        ("10.0.0:80", "10.0.0 is not a valid IPv4 address"),
        ("[::g1]:80", "::g1 is not a valid IPv6 address"),
        ("bad_host!:80", "bad_host! is not a valid host name"),
        ("127.0.0.1:65536", "port 65536 is out of range"),
        ("127.0.0.1:http", "port http is not a number"),
        ("localhost:²", "port ² is not a number"),  # str.isdigit() takes it, int() did not: a raw "invalid literal"
        ("localhost:８０", "port ８０ is not a number"),  # int() takes it, and the value was kept as typed
        ("[::1:80", "[::1 has no closing ]"),  # was "::1:80 is not a valid IPv6 address", a part cut wrong
        ("[abc:80", "[abc has no closing ]"),  # was "ab is not a valid IPv6 address"
        ("my host:80", "my host is not a valid host name"),
    ],
)
def test_a_listen_address_with_a_bad_host_or_port_is_refused_naming_that_part(tmp_path, listen, said):
    # `--listen 999.1.1.1:80` was refused as "reachable from other machines … Listen on 127.0.0.1": the address was
    # not an address at all, and the message sent the user after the wrong problem.
    for key in ("proxy.listen", "metrics.listen"):
        section, _, name = key.partition(".")
        for how in ({"overrides": {key: listen}},
                    {"path": _write(tmp_path, f"[{section}]\n{name} = '{listen}'\n")}):  # the file, as --check reads it
            with pytest.raises(ConfigError) as e:
                load_config(how.get("path"), env={}, overrides=how.get("overrides"))
            msg = str(e.value)
            assert key in msg and said in msg, msg
            assert "reachable from other machines" not in msg, msg


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "127.0.0.1:8081", "[::1]:9464", "localhost:8081",
                                    "unix:/run/x.sock", ""])
def test_good_listen_addresses_pass(listen):
    assert load_config(None, env={}, overrides={"proxy.listen": listen}).get("proxy", "listen") == listen


@pytest.mark.parametrize("listen, kept", [("localhost.:8081", "localhost:8081"), ("127.0.0.1.:8081", "127.0.0.1:8081"),
                                          ("my_host:8081", "my_host:8081"), ("web_1.my_net.:80", "web_1.my_net:80")])
def test_a_host_name_with_underscores_or_a_trailing_dot_passes(listen, kept):
    # Docker's service names (`my_host`) were refused as "not a valid host name"; `127.0.0.1.:80` (a fully qualified
    # name's trailing dot) was called "not a valid IPv4 address", and `localhost.` does not resolve from /etc/hosts:
    # the dot is dropped, and the host judged (and the loopback rule applied) without it.
    cfg = load_config(None, env={}, overrides={"proxy.listen": listen, "daemon.listen_beyond_loopback": True})
    assert cfg.get("proxy", "listen") == kept
    if kept.startswith(("localhost", "127.")):
        assert load_config(None, env={}, overrides={"proxy.listen": listen}).get("proxy", "listen") == kept


@pytest.mark.parametrize("url, said", [("http://localhost:99999", "port 99999 is out of range: 1-65535"),
                                       ("http://127.0.0.1:0", "port 0 is out of range: 1-65535"),
                                       ("http://[::1]:http", "port http is not a number"),
                                       ("https://localhost:８０", "port ８０ is not a number")])
def test_a_url_with_a_port_no_server_can_have_is_refused_naming_the_port(url, said):
    # Before: `--upstream http://localhost:99999` passed, and the start's check of the upstream said only "its port
    # is not a number".
    for key in ("proxy.upstream", "scrape.url"):
        with pytest.raises(ConfigError) as e:
            load_config(None, env={}, overrides={key: url})
        assert key in str(e.value) and said in str(e.value), str(e.value)
    for good in ("http://127.0.0.1:1", "http://[::1]:65535/v1", "https://localhost", "http://my_host:8000"):
        assert load_config(None, env={}, overrides={"proxy.upstream": good}).get("proxy", "upstream") == good


def test_paths_in_the_config_have_a_leading_tilde_expanded(tmp_path, monkeypatch):
    # Before: `data_dir = "~/pp"` was taken as a folder named `~` in the working directory, and the refusal of a data
    # dir whose parent is missing advised `mkdir -p <cwd>/~`. No shell expands a config file's text, nor systemd's
    # Environment=.
    monkeypatch.setenv("HOME", str(tmp_path))
    p = _write(tmp_path, '[daemon]\ndata_dir = "~/pp"\n[tags]\nsocket = "~/run/pp.sock"\n'
                         '[proxy]\nlisten = "unix:~/run/proxy.sock"\n[metrics]\nlisten = "unix:~/run/m.sock"\n')
    for cfg in (load_config(p, env={}), load_config(None, env={"POWERPROF_DAEMON_DATA_DIR": "~/pp",
                                                                "POWERPROF_TAGS_SOCKET": "~/run/pp.sock",
                                                                "POWERPROF_PROXY_LISTEN": "unix:~/run/proxy.sock",
                                                                "POWERPROF_METRICS_LISTEN": "unix:~/run/m.sock"})):
        assert cfg.data_dir() == tmp_path / "pp"
        assert cfg.tag_socket() == tmp_path / "run" / "pp.sock"
        assert cfg.get("proxy", "listen") == f"unix:{tmp_path / 'run' / 'proxy.sock'}"
        assert cfg.get("metrics", "listen") == f"unix:{tmp_path / 'run' / 'm.sock'}"


def test_a_valid_address_beyond_loopback_is_still_refused_without_the_flag():
    for listen in ("10.0.0.1:80", "[2001:db8::1]:80", "gpu-node-07.example:80"):
        with pytest.raises(ConfigError, match="reachable from other machines"):
            load_config(None, env={}, overrides={"proxy.listen": listen})


@pytest.mark.parametrize("make", ["file", "under-a-file"])
def test_a_data_dir_that_cannot_be_a_folder_fails_the_check(tmp_path, make):
    # `data_dir = "/etc/passwd"` passed `daemon --check` and failed at start.
    from click.testing import CliRunner

    from powerprof.cli import main

    f = tmp_path / "afile"
    f.write_text("not a folder")
    d = f if make == "file" else f / "sub"
    with pytest.raises(ConfigError, match=rf"daemon.data_dir = '{d}'.* is not a folder"):
        load_config(None, env={}, overrides={"daemon.data_dir": str(d)})
    p = _write(tmp_path, f'[daemon]\ndata_dir = "{d}"\n')
    r = CliRunner().invoke(main, ["daemon", "--check", "--config", str(p)])
    assert r.exit_code != 0 and "is not a folder: " in r.output and "config OK" not in r.output, r.output
    assert f.read_text() == "not a folder"
    (tmp_path / "new").mkdir()  # a given data dir's parent must be there (missing_parent_text); the dir is made at start
    load_config(None, env={}, overrides={"daemon.data_dir": str(tmp_path / "new" / "dir")})


@pytest.mark.parametrize("mark", ["run.json", "windows.parquet"])
def test_a_data_dir_that_holds_a_sweeps_run_is_refused_before_anything_is_written(tmp_path, mark, monkeypatch):
    # `daemon --data-dir RUN` (a copy of a sweep's run) passed --check and started: its datasets beside the run's tables
    # made `analyze RUN` show the daemon's summary in the run's stead, and `export RUN` the run's tables alone.
    from click.testing import CliRunner

    from powerprof.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / mark).write_text("the run's own")
    with pytest.raises(ConfigError, match=rf"daemon.data_dir = '{run}'.* holds a sweep's run \({mark}\)"):
        load_config(None, env={}, overrides={"daemon.data_dir": str(run)})
    for check in (["--check"], []):
        r = CliRunner().invoke(main, ["daemon", "--simulate", "--data-dir", str(run), "--listen", "127.0.0.1:0",
                                      "--metrics-listen", "127.0.0.1:0", *check])
        assert r.exit_code == 2 and "holds a sweep's run" in r.output and "config OK" not in r.output, r.output
        assert sorted(p.name for p in run.iterdir()) == [mark] and (run / mark).read_text() == "the run's own"
    # The default data dir too ($STATE_DIRECTORY, as the unit sets it).
    monkeypatch.setenv("STATE_DIRECTORY", str(run))
    with pytest.raises(ConfigError, match=rf"the default data dir {run} holds a sweep's run"):
        load_config(None, env={})
    load_config(None, env={}, overrides={"daemon.data_dir": str(tmp_path)})  # the folder above it: fine


def test_a_data_dir_inside_a_sweeps_run_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    # `daemon --data-dir RUN/analysis` passed --check and started: `analyze RUN` then wrote its report into the
    # daemon's folder, and `export` of that folder read analysis.parquet alone, the daemon's requests, intervals and
    # samples left out unsaid. Anywhere in a run's analysis folder, or not made yet there, is refused the same way.
    from click.testing import CliRunner

    from powerprof.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text('{"kind": "sweep", "run_id": "0123456789ab"}')
    for inside in (run / "analysis", run / "analysis" / "not-made-yet"):
        with pytest.raises(ConfigError, match=rf"daemon.data_dir = '{inside}'.* is inside a sweep's run folder's "
                                              rf"analysis, {run / 'analysis'} \(run.json in {run}\).*give the daemon a "
                                              "folder of its own, outside it"):
            load_config(None, env={}, overrides={"daemon.data_dir": str(inside)})
        for check in (["--check"], []):
            r = CliRunner().invoke(main, ["daemon", "--simulate", "--data-dir", str(inside), "--listen", "127.0.0.1:0",
                                          "--metrics-listen", "127.0.0.1:0", *check])
            assert r.exit_code == 2 and "is inside a sweep's run folder's analysis" in r.output, r.output
            assert "config OK" not in r.output and sorted(p.name for p in run.iterdir()) == ["run.json"], r.output
    monkeypatch.setenv("STATE_DIRECTORY", str(run / "analysis" / "state"))
    with pytest.raises(ConfigError, match=r"the default data dir .* is inside a sweep's run folder's analysis"):
        load_config(None, env={})
    load_config(None, env={}, overrides={"daemon.data_dir": str(tmp_path / "daemon")})  # beside the run: fine
    # Elsewhere in a run no command of the run's reads it (`analyze RUN` writes RUN/analysis alone): accepted.
    load_config(None, env={}, overrides={"daemon.data_dir": str(run / "node1")})


def test_a_data_dir_below_another_tools_run_json_is_not_refused(tmp_path, monkeypatch):
    # The review: a home folder holding another tool's run.json (sacred writes one a run, many CI jobs do) refused the
    # daemon's default data dir below it, "inside a sweep's run folder", exit 2.
    home = tmp_path / "home"
    (home / "analysis").mkdir(parents=True)
    (home / "run.json").write_text('{"name": "my-ci-job"}')
    monkeypatch.setenv("STATE_DIRECTORY", str(home / "analysis" / "powerprof"))
    load_config(None, env={})
    (home / ".local" / "state" / "powerprof").mkdir(parents=True)  # a given data dir's parent must be there
    load_config(None, env={}, overrides={"daemon.data_dir": str(home / ".local" / "state" / "powerprof" / "daemon")})


@pytest.mark.parametrize("proxy,metrics,beyond", [
    ("127.0.0.1:9000", "127.0.0.1:9000", False),
    ("0.0.0.0:9000", "127.0.0.1:9000", True),  # the wildcard takes every address's port
    ("127.0.0.1:9000", "[::]:9000", True),  # :: is dual-stack on Linux by default
    ("localhost:9000", "127.0.0.1:9000", False),  # a name may be that address
    ("unix:/run/x.sock", "unix:/run/x.sock", False),
])
def test_proxy_and_metrics_on_one_address_fail_the_check(tmp_path, proxy, metrics, beyond):
    # They passed `daemon --check`; the second bind failed at start (or, with SO_REUSEPORT, shared the port).
    overrides = {"proxy.listen": proxy, "metrics.listen": metrics, "daemon.listen_beyond_loopback": beyond}
    with pytest.raises(ConfigError, match="proxy.listen .* and metrics.listen .* the same"):
        load_config(None, env={}, overrides=overrides)


@pytest.mark.parametrize("proxy,metrics", [
    ("127.0.0.1:9000", "127.0.0.1:9001"), ("127.0.0.1:9000", "[::1]:9000"), ("127.0.0.1:0", "127.0.0.1:0"),
    ("127.0.0.1:9000", ""), ("", ""),
])
def test_proxy_and_metrics_on_different_addresses_pass(proxy, metrics):
    load_config(None, env={}, overrides={"proxy.listen": proxy, "metrics.listen": metrics})


@pytest.mark.parametrize("listen,upstream,beyond", [
    ("127.0.0.1:18081", "http://127.0.0.1:18081", False),
    ("127.0.0.1:18081", "http://localhost:18081/", False),
    ("127.0.0.1:18081", "http://0.0.0.0:18081", False),  # connecting to 0.0.0.0 reaches 127.0.0.1
    ("localhost:18081", "http://127.0.0.1:18081", False),
    ("[::1]:18081", "http://[::]:18081", False),
    ("[::1]:18081", "http://localhost.:18081", False),
    ("127.0.0.1:80", "http://127.0.0.1", False),  # the scheme's port
    ("0.0.0.0:18081", "http://127.0.0.5:18081", True),  # the wildcard takes every local address
    ("[::]:18081", "http://[::1]:18081", True),
    ("[::]:18081", "http://127.0.0.1:18081", True),  # dual-stack
    ("10.0.0.5:18081", "https://10.0.0.5:18081", True),
])
def test_an_upstream_that_is_the_proxys_own_listen_address_fails_the_check(listen, upstream, beyond):
    # It passed `daemon --check` ("config OK"); each request then went round the proxy: one curl hung 10 s and the
    # dataset held 1090 request rows (1027 of them 502) for it.
    overrides = {"proxy.listen": listen, "proxy.upstream": upstream, "daemon.listen_beyond_loopback": beyond}
    with pytest.raises(ConfigError, match="proxy.upstream = .* is the proxy's own listen address"):
        load_config(None, env={}, overrides=overrides)


@pytest.mark.parametrize("listen,upstream", [
    ("127.0.0.1:18081", "http://127.0.0.1:8080"), ("127.0.0.1:18081", "http://127.0.0.2:18081"),
    ("127.0.0.1:18081", "http://[::1]:18081"), ("[::1]:18081", "http://127.0.0.1:18081"),
    ("127.0.0.1:18081", "http://gpu-box:18081"), ("127.0.0.1:0", "http://127.0.0.1:18081"),
    ("127.0.0.1:443", "http://127.0.0.1"), ("unix:/run/p.sock", "http://127.0.0.1:18081"), ("", "http://127.0.0.1:1"),
])
def test_an_upstream_on_another_address_or_port_passes(listen, upstream):
    load_config(None, env={}, overrides={"proxy.listen": listen, "proxy.upstream": upstream})


@pytest.mark.parametrize("scrape_url,refused", [
    ("http://127.0.0.1:28301", True), ("http://localhost:28301/", True), ("http://127.0.0.1:8080", False), ("", False),
])
def test_a_scrape_url_that_is_the_proxys_own_listen_address_fails_the_check(scrape_url, refused):
    # It passed `daemon --check`; then every scrape was answered 508 by the proxy and the log blamed proxy.upstream.
    overrides = {"proxy.listen": "127.0.0.1:28301", "proxy.upstream": "http://127.0.0.1:8080", "scrape.url": scrape_url}
    if not refused:
        load_config(None, env={}, overrides=overrides)
        return
    with pytest.raises(ConfigError, match="scrape.url = .* is the proxy's own listen address") as e:
        load_config(None, env={}, overrides=overrides)
    assert "proxy.upstream =" not in str(e.value)


def test_the_config_check_loads_no_pyarrow_and_tag_is_not_refused_for_the_data_dir(tmp_path):
    # The data-dir check (a folder holding a sweep's run) imported storage.runs, so pyarrow (~45 MiB) rode into every
    # daemon start, in a unit capped at MemoryMax=512M (tests/test_daemon_e2e.py's footprint check failed). And
    # `powerprof tag`, which reads the config for its socket only, was refused for the daemon's data dir.
    import subprocess

    code = ("import sys; from powerprof.daemon.config import load_config; load_config(None); "
            "assert 'pyarrow' not in sys.modules, 'pyarrow loaded by load_config'")
    env = {**os.environ, "POWERPROF_STATE_DIR": str(tmp_path / "state")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    with pytest.raises(ConfigError, match="sweep's run"):
        load_config(None, env={}, overrides={"daemon.data_dir": str(run)})
    assert load_config(None, env={}, overrides={"daemon.data_dir": str(run)}, data_dir_checked=False).data_dir() == run


@pytest.mark.parametrize("key", ["tags.socket", "proxy.listen"])
def test_a_socket_path_past_the_kernels_limit_is_refused_at_check(tmp_path, key):
    # The hostile battery's: --check said "config OK"; at start the proxy's exited 1, and the tag socket's was logged
    # while the daemon ran on with no tag API (`powerprof tag` then found no daemon).
    long = str(tmp_path / ("d" * 120 + ".sock"))
    value = long if key == "tags.socket" else "unix:" + long
    with pytest.raises(ConfigError, match=f"config key {key}: the socket path .* more than the 107"):
        load_config(None, env={}, overrides={key: value, "daemon.data_dir": str(tmp_path / "d")})
    short = str(tmp_path / "p.sock")
    load_config(None, env={}, overrides={key: short if key == "tags.socket" else "unix:" + short,
                                         "daemon.data_dir": str(tmp_path / "d")})
