"""Daemon configuration: TOML file, then POWERPROF_<SECTION>_<KEY> environment, then CLI flags.

Every key is declared once in SPEC with its type, default and check. Unknown keys and bad values
are rejected at start (and at SIGHUP reload) with a message naming the key, before anything runs.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from powerprof.paths import (OUTPUT_DEPTH_BYTES, RUN_MARKS, STATE_DIR_ENV, cwd_gone, cwd_joined, holds_sweep_run,
                             is_powerprof_run, path_max_problem, path_problem, user_state_home)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "POWERPROF_"


class ConfigError(ValueError):
    """A bad config: the message names the key and says what is accepted (every bad key, one per line)."""

    def __init__(self, message: str, errors: list[str] | None = None):
        super().__init__(message)
        self.errors = errors or [message]


def _raise_all(errors: list[str]) -> None:
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError(f"{len(errors)} config errors:\n  " + "\n  ".join(errors), errors)


def _path(v: str) -> str:
    """A path key's value, a leading `~` expanded: no shell expands a config file's text, nor systemd's Environment=
    (`data_dir = "~/pp"` was a folder named `~` in the working directory)."""
    return os.path.expanduser(v) if v else v


def _listen(v: str) -> str:
    if v == "":
        return v
    if v.startswith("unix:"):
        return "unix:" + _path(v[5:])
    host, sep, port = v.rpartition(":")
    if not sep or not host:
        raise ValueError("expected HOST:PORT (port 0-65535), e.g. 127.0.0.1:9464, or empty to disable")
    if host.startswith("[") and not host.endswith("]"):
        raise ValueError(f"{host} has no closing ]; an IPv6 address takes brackets: [::1]:9464")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError("an IPv6 address takes brackets: [::1]:9464")
    # Each part judged by itself: `999.1.1.1:80` was refused as "reachable from other machines", sending the user
    # after the wrong problem (the port was checked here, the host only by the loopback rule). ASCII digits only:
    # str.isdigit() takes `²` (int() then failed with its own words) and `８０` (kept as typed).
    if not (port.isascii() and port.isdigit()):
        raise ValueError(f"port {port or '(none)'} is not a number; expected HOST:PORT (port 0-65535, 0: any free "
                         "one), e.g. 127.0.0.1:9464")
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"port {port} is out of range: 0-65535 (0: any free one), e.g. 127.0.0.1:9464")
    if not host.startswith("[") and host.endswith(".") and host != ".":
        # A fully qualified name's trailing dot, dropped: `localhost.` does not resolve from /etc/hosts, and the
        # loopback rule knows `localhost` and 127.0.0.1 without it.
        host = host[:-1]
        v = f"{host}:{port}"
    problem = _host_problem(host)
    if problem:
        raise ValueError(f"{problem}; expected an IPv4 address (four numbers 0-255: 127.0.0.1), an IPv6 one in "
                         "brackets ([::1]) or a host name (localhost)")
    return v


def _host_problem(host: str) -> str | None:
    """Why `host` (as written in a listen address, IPv6 in brackets, no trailing dot) is no address to listen on;
    None when it is one. A name is judged by its form only: resolving it here would block a SIGHUP reload on DNS,
    and a name that does not resolve fails the bind at start, naming the address and the key. Underscores are
    taken, as resolvers take them: Docker's service names (`my_host`) have them."""
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host[1:-1]} is not a valid IPv6 address"
        return None
    labels = host.split(".")
    if all(x.isascii() and x.isdigit() for x in labels):  # dotted digits are meant as IPv4 (no host name is all digits)
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host} is not a valid IPv4 address"
        return None
    ok = len(host) <= 253 and all(
        0 < len(x) <= 63 and x[0] != "-" and x[-1] != "-"
        and all(c.isascii() and (c.isalnum() or c in "-_") for c in x)
        for x in labels)
    return None if ok else f"{host} is not a valid host name (ASCII letters, digits, hyphens, underscores and dots)"


def listen_host(listen: str) -> str | None:
    """The host of a HOST:PORT listen address without IPv6 brackets; None for unix: or empty."""
    if not listen or listen.startswith("unix:"):
        return None
    return listen.rpartition(":")[0].strip("[]")


def is_loopback(host: str) -> bool:
    """Only this machine can connect. A host name other than localhost may resolve anywhere: not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url(v: str) -> str:
    if v == "":
        return v
    u = urlsplit(v)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError("expected an http:// or https:// URL, e.g. http://127.0.0.1:8080")
    # The port as written (after an IPv6 address's brackets): urlsplit takes `:99999` and `:８０` until .port is
    # read, and the start's upstream check then said only "its port is not a number". Both keys name a server to
    # connect to: port 0 names none.
    _, sep, port = u.netloc.rpartition("@")[2].rpartition("]")[2].rpartition(":")
    if sep and port:
        if not (port.isascii() and port.isdigit()):
            raise ValueError(f"port {port} is not a number; expected a port 1-65535, e.g. http://127.0.0.1:8080")
        if not 1 <= int(port) <= 65535:
            raise ValueError(f"port {port} is out of range: 1-65535, e.g. http://127.0.0.1:8080")
    return v.rstrip("/")


def _positive(lo: float = 0.0, hi: float = float("inf"), inclusive_lo: bool = False):
    def check(v):
        if not ((v >= lo if inclusive_lo else v > lo) and v <= hi):
            bound = f"{'>=' if inclusive_lo else '>'} {lo}" + (f" and <= {hi}" if hi != float("inf") else "")
            raise ValueError(f"must be {bound}")
        return v

    return check


def _choice(*options):
    def check(v):
        if v not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return v

    return check


def _header(v: str) -> str:
    """replay's --tag-header rule (workload.auth.check_tag_header): Content-Length and Host were accepted here."""
    from powerprof.workload.auth import check_tag_header  # noqa: PLC0415

    return check_tag_header(v)


def _gpu_list(v):
    """NVML indexes or UUIDs (GPU-…, or MIG-… standing for its parent GPU), as `--gpus` takes them: an index is
    not stable across reboots, driver reloads or CUDA_VISIBLE_DEVICES orderings, a UUID is. Whether each names
    a GPU of this machine is checked when the GPUs are opened (the daemon then stops, naming it)."""
    def ok(x) -> bool:
        if isinstance(x, bool):
            return False
        if isinstance(x, int):
            return x >= 0
        return isinstance(x, str) and x.startswith(("GPU-", "MIG-")) and len(x) > 4 and not any(c.isspace() for c in x)
    if not all(ok(x) for x in v):
        raise ValueError("must be a list of GPU indexes (integers >= 0) or UUIDs (GPU-…, MIG-…; nvidia-smi -L lists them)")
    return list(dict.fromkeys(v))


def _serving_not_sampled(serving, sampled) -> str | None:
    """Why `daemon.serving_gpus` names a GPU `daemon.gpus` does not sample, where the config alone can tell: an index
    beside indexes, a GPU- UUID (or prefix) beside GPU- UUIDs; the rest (kinds mixed, MIG-, every GPU sampled) is
    checked against NVML at start (Daemon._asserted_serving). None where nothing is wrong that far."""
    if not isinstance(serving, list) or not isinstance(sampled, list) or not sampled:
        return None
    ints = [g for g in sampled if isinstance(g, int)]
    uuids = [g for g in sampled if isinstance(g, str) and g.startswith("GPU-")]
    for g in serving:
        if isinstance(g, int) and len(ints) == len(sampled) and g not in ints:
            break
        if (isinstance(g, str) and g.startswith("GPU-") and len(uuids) == len(sampled)
                and not any(u.startswith(g) or g.startswith(u) for u in uuids)):
            break
    else:
        return None
    return (f"{g!r} is not in daemon.gpus = {sampled!r}: only a sampled GPU's energy can be the work's; add it to "
            "daemon.gpus, or name only sampled GPUs (empty: let the daemon judge)")


def _str_list(v):
    if not all(isinstance(x, str) and x for x in v):
        raise ValueError("must be a list of non-empty strings")
    return v


def _zero_or(check):
    def inner(v):
        return v if v == 0 else check(v)

    return inner


def _ident(v):
    return v


@dataclass(frozen=True)
class Key:
    type: type
    default: Any
    check: Callable = _ident
    reloadable: bool = False
    help: str = ""
    item: type | None = None  # a list key's element type: what each comma-separated part of its env text is


# daemon.interval_s's largest: `powerprof tag stop` waits for the daemon's stop at this interval (tagapi).
INTERVAL_MAX_S = 10.0


SPEC: dict[str, dict[str, Key]] = {
    "daemon": {
        "interval_s": Key(float, 1.0, _positive(0.02, INTERVAL_MAX_S, True), help="sampling period (0.02-10 s)"),
        "data_dir": Key(str, "", _path, help="dataset root; default $STATE_DIRECTORY, then the user state folder"),
        "flush_interval_s": Key(float, 30.0, _positive(0.05, 3600), True, "seconds between Parquet flushes"),
        "compact_interval_s": Key(float, 3600.0, _positive(1, 86400 * 7, True), True, "seconds between compactions"),
        "retention_days": Key(float, 30.0, _positive(0, 36500, True), True, "delete partitions older; 0 = keep"),
        "retention_max_mb": Key(float, 0.0, _positive(0, 1e9, True), True, "cap on dataset size; 0 = none"),
        "max_buffered_rows": Key(int, 0, _zero_or(_positive(100, 1e9, True)), True,
                                 "rows kept in memory per dataset while writes fail; 0 = derived from the memory limit"),
        "listen_beyond_loopback": Key(bool, False, help="allow proxy/metrics listen addresses other than loopback "
                                      "(the proxy has no authentication: firewall it)"),
        "gpus": Key(list, [], _gpu_list, help="NVML indexes or GPU-/MIG- UUIDs to sample; empty = all visible", item=int),
        "serving_gpus": Key(list, [], _gpu_list, item=int,
                            help="of the sampled GPUs, those the proxied server runs on (indexes or UUIDs), asserted where "
                            "the daemon cannot see its processes; empty = judged (its processes, the GPUs' power)"),
        "log_level": Key(str, "info", _choice("debug", "info", "warning", "error"), True),
        "restore_on_start": Key(bool, True, help="restore limits left by a crashed sweep"),
        "host": Key(str, "", help="the host column of every dataset row; default the machine's host name"),
    },
    "proxy": {
        "listen": Key(str, "127.0.0.1:8081", _listen, help="proxy address; empty disables the proxy"),
        "upstream": Key(str, "", _url, help="inference server URL the proxy forwards to"),
        "tag_header": Key(str, "X-Powerprof-Tag", _header, help="request header carrying the client tag"),
        "read_timeout_s": Key(float, 600.0, _positive(0, 86400), help="upstream silence before a response is cut"),
        "connect_timeout_s": Key(float, 10.0, _positive(0, 600), help="connecting to the upstream"),
        "max_connections": Key(int, 1024, _positive(0, 100000, True), help="upstream connection pool; 0 = unlimited"),
        "header_timeout_s": Key(float, 10.0, _positive(0, 3600),
                                help="a client connection must send a whole request head within this (slowloris)"),
        "idle_timeout_s": Key(float, 75.0, _positive(0, 86400),
                              help="an idle keep-alive client connection is closed after this"),
        "body_timeout_s": Key(float, 60.0, _positive(0, 86400),
                              help="longest silence while reading a request body (408 after)"),
        "body_min_bytes_per_s": Key(float, 1024.0, _positive(0, 1e9, True),
                                    help="a streamed request body must average this after its first body_timeout_s "
                                    "(408 else); 0 = no rate, silence alone"),
        "workers": Key(int, 1, _positive(1, 64, True),
                       help="proxy processes on the listen port (SO_REUSEPORT); 1 = the proxy runs in the daemon"),
    },
    "scrape": {
        "server": Key(str, "auto", _choice("auto", "vllm", "sglang", "llamacpp", "none")),
        "url": Key(str, "", _url, help="server to scrape; default the proxy upstream"),
        "interval_s": Key(float, 0.25, _positive(0.1, 3600, True), True,
                          "scrape period: bypass tokens are placed within a window this long"),
        "idle_interval_s": Key(float, 2.0, _positive(0.1, 3600, True), True,
                               "scrape period once the server's counter and the proxy are still"),
    },
    "metrics": {
        "listen": Key(str, "127.0.0.1:9464", _listen, help="Prometheus /metrics address; empty disables"),
        "tags": Key(list, [], _str_list, True, "tag label allow-list; others count as 'other'", item=str),
        "max_tags": Key(int, 20, _positive(0, 1000), True, "distinct tag label values before 'other'"),
        "jpt_window_s": Key(float, 60.0, _positive(1, 86400), True, "window of the rolling J/token gauge"),
    },
    "tags": {
        "socket": Key(str, "", _path, help="tag API Unix socket; default $RUNTIME_DIRECTORY or the data dir"),
    },
    "attribution": {
        "edge_max_inflight": Key(int, 4, _positive(0, 100000), True,
                                 "read the GPU counter at a request's arrival, first token and end while at most this many are in flight; 0 = never"),
        "edge_max_per_s": Key(float, 20.0, _positive(0.1, 1000), True, "at most this many such reads a second"),
        "edge_cpu_share": Key(float, 0.01, _positive(0.0001, 1), True,
                              "and no more often than keeps their own measured CPU time under this share of one core"),
    },
}


def _coerce(section: str, key: str, spec: Key, value: Any, from_env: str | None = None,
            where: str | None = None) -> Any:
    """The checked value; ConfigError naming the key and where it came from: the file (`where`), or
    the environment variable `from_env` with the text it held, since that is what the user must fix."""
    name = f"{section}.{key}"
    text = value
    try:
        if from_env is not None:
            try:
                value = _from_text(spec.type, value, spec.item)
            except ValueError:
                raise ValueError(f"must be {_EXPECTED[spec.type]}") from None
        if spec.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if spec.type is bool and not isinstance(value, bool):
            raise ValueError("must be true or false")
        if not isinstance(value, spec.type) or (spec.type is int and isinstance(value, bool)):
            raise ValueError(f"must be of type {spec.type.__name__}, got {type(value).__name__}")
        return spec.check(value)
    except ValueError as e:
        if from_env is not None:
            raise ConfigError(f"environment variable {from_env}={text!r} (config key {name}): {e}") from None
        raise ConfigError(f"config key {name} = {value!r}{f' {where}' if where else ''}: {e}") from None


# What an environment variable's text must look like, by the key's type.
_EXPECTED = {
    float: "a number (e.g. 1.5)",
    int: "a whole number (e.g. 4)",
    bool: "true or false (or 1/0, yes/no, on/off)",
    list: "a comma-separated list (e.g. 0,1)",
    str: "text",
}


def _from_text(t: type, text: str, item: type | None = None):
    if t is str:
        return text
    if t is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError("must be true or false")
    if t is int:
        return int(text)
    if t is float:
        return float(text)
    if t is list:
        # By the key's element type, not by the look of each part: a tag label "2024" is text.
        items = [x.strip() for x in text.split(",") if x.strip()]
        if item is str:
            return items
        return [int(x) if x.isdigit() else x for x in items]  # a part that is not one is named by the key's check
    raise ValueError(f"unsupported type {t}")


@dataclass(frozen=True)
class Config:
    values: dict  # {section: {key: value}}
    source: str  # where it came from, for logs

    def get(self, section: str, key: str):
        return self.values[section][key]

    def host(self) -> str:
        """What every dataset row names as its machine: daemon.host, else the host name."""
        import socket

        return self.get("daemon", "host") or socket.gethostname()

    def data_dir(self) -> Path:
        d = self.get("daemon", "data_dir")
        if d:
            return Path(d)
        if os.environ.get("STATE_DIRECTORY"):
            return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
        base = os.environ.get(STATE_DIR_ENV)
        return (Path(base) if base else user_state_home() / "powerprof") / "daemon"

    def tag_socket(self) -> Path:
        s = self.get("tags", "socket")
        if s:
            return Path(s)
        return default_tag_socket(self.data_dir())

    def reload_changes(self, new: "Config") -> tuple[dict, list[str]]:
        """(changes that apply live, names of changed keys that need a restart)."""
        live, restart = {}, []
        for section, keys in SPEC.items():
            for key, spec in keys.items():
                a, b = self.get(section, key), new.get(section, key)
                if a != b:
                    if spec.reloadable:
                        live[f"{section}.{key}"] = b
                    else:
                        restart.append(f"{section}.{key}")
        return live, restart


# The shipped unit's socket (RuntimeDirectory=powerprof): where a client with no --socket and no config looks next.
SYSTEMD_TAG_SOCKET = Path("/run/powerprof/powerprof.sock")


def default_tag_socket(data_dir: Path) -> Path:
    run = os.environ.get("RUNTIME_DIRECTORY")
    if run:
        return Path(run.split(":")[0]) / "powerprof.sock"
    return Path(data_dir) / "powerprof.sock"


def load_config(path: str | os.PathLike | None = None, env: dict | None = None, overrides: dict | None = None,
                flags: dict | None = None, data_dir_checked: bool = True) -> Config:
    """File (optional) → env → overrides {"section.key": value}; raises ConfigError naming every bad key.

    flags: the command-line flag each override came from ({"daemon.data_dir": "--data-dir"}), so
    Config.source names what the user typed. data_dir_checked False: a caller that only reads the config (`powerprof
    tag`, for the socket) is not refused for a data folder the daemon would refuse (`_holds_a_run`)."""
    env = os.environ if env is None else env
    errors: list[str] = []

    origin: dict[str, str] = {}  # "section.key" → where its value came from, for the checks across keys

    def coerce(section, key, value, from_env=None, where=None):
        try:
            values[section][key] = _coerce(section, key, SPEC[section][key], value, from_env=from_env, where=where)
            origin[f"{section}.{key}"] = f"environment variable {from_env}" if from_env else (where or "").split(" ", 1)[-1]
        except ConfigError as e:
            errors.append(str(e))

    def came_from(*dotted) -> str:
        said = [f"{d} from {origin[d]}" for d in dotted if origin.get(d)]
        return f" ({'; '.join(said)})" if said else ""

    values = {s: {k: spec.default for k, spec in keys.items()} for s, keys in SPEC.items()}
    sources = ["defaults"]
    if path is not None:
        p = Path(path)
        try:
            if os.geteuid() == 0:
                # Root follows it: its data dir, socket (a stale one there is replaced) and upstream. A file
                # another user could write (or a symlink another user owns, or one in a folder they can write,
                # on the way to it) is not used.
                from powerprof.trust import read_trusted

                text = read_trusted(p, euid=0).decode("utf-8", "replace")
            else:
                text = p.read_text()
            raw = tomllib.loads(text)
        except FileNotFoundError:
            raise ConfigError(cwd_gone(p, "config file") or f"config file {p} does not exist") from None
        except PermissionError as e:
            if os.geteuid() == 0 and e.filename is None:  # read_trusted's refusal: the reason is its message
                raise ConfigError(f"not using config file {p} as root: {e}") from None
            raise ConfigError(f"config file {p} is not readable (permission denied)") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError(f"not using config file {p} as root: too many levels of symlinks") from None
            raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        except RecursionError:  # nested past Python's stack: no TOMLDecodeError, and the daemon exited 1, a traceback
            raise ConfigError(f"config file {p} is not valid TOML: nested deeper than Python's parser goes") from None
        for section, table in raw.items():
            if section not in SPEC:
                errors.append(f"unknown config section [{section}] in {p}; known: {', '.join(SPEC)}")
                continue
            if not isinstance(table, dict):
                errors.append(f"config key {section} in {p} must be a [{section}] table")
                continue
            for key, value in table.items():
                if key not in SPEC[section]:
                    errors.append(
                        f"unknown config key {section}.{key} in {p}; known keys of [{section}]: {', '.join(SPEC[section])}"
                    )
                    continue
                coerce(section, key, value, where=f"in {p}")
        sources.append(str(p))
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        section = next((s for s in SPEC if rest.startswith(s + "_")), None)
        if section is None:
            continue  # other POWERPROF_* variables (simulator, state dir) are not daemon config
        key = rest[len(section) + 1:]
        if key not in SPEC[section]:
            errors.append(f"unknown config key {section}.{key} from environment variable {name}")
            continue
        coerce(section, key, text, from_env=name)
        sources.append(name)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        if section not in SPEC or key not in SPEC[section]:
            errors.append(f"unknown config key {dotted}")
            continue
        flag = (flags or {}).get(dotted)
        coerce(section, key, value, where=f"from {flag}" if flag else None)
        sources.append((flags or {}).get(dotted, dotted))
    for section in ("proxy", "metrics"):
        listen = values[section]["listen"]
        host = listen_host(listen) if isinstance(listen, str) else None
        if host is not None and not is_loopback(host) and not values["daemon"]["listen_beyond_loopback"]:
            errors.append(
                f"config key {section}.listen = {listen!r}{came_from(section + '.listen')} is reachable from other machines; "
                "the proxy and /metrics have no authentication. Listen on 127.0.0.1 or [::1], or set "
                "daemon.listen_beyond_loopback = true (and firewall it)"
            )
    proxy_l, metrics_l = values["proxy"]["listen"], values["metrics"]["listen"]
    if isinstance(proxy_l, str) and isinstance(metrics_l, str) and _same_address(proxy_l, metrics_l):
        errors.append(f"config keys proxy.listen = {proxy_l!r} and metrics.listen = {metrics_l!r}"
                      f"{came_from('proxy.listen', 'metrics.listen')} name the same address: the second bind fails at "
                      "start; give them different ports (or sockets)")
    upstream = values["proxy"]["upstream"]
    if isinstance(proxy_l, str) and isinstance(upstream, str) and _upstream_is_listen(upstream, proxy_l):
        # It passed --check; then each request was forwarded to the proxy itself, round and round: one curl hung 10 s
        # and the dataset held 1090 request rows for it.
        errors.append(f"config key proxy.upstream = {upstream!r} is the proxy's own listen address, proxy.listen = "
                      f"{proxy_l!r}{came_from('proxy.upstream', 'proxy.listen')}: every request would be sent back to "
                      "the proxy, round and round; give the inference server's URL (its own port)")
    scrape_url = values["scrape"]["url"]
    if isinstance(proxy_l, str) and isinstance(scrape_url, str) and _upstream_is_listen(scrape_url, proxy_l):
        # It passed --check; then every scrape was answered 508 by the proxy, the figures flagged.
        errors.append(f"config key scrape.url = {scrape_url!r} is the proxy's own listen address, proxy.listen = "
                      f"{proxy_l!r}{came_from('scrape.url', 'proxy.listen')}: every scrape would reach the proxy and be "
                      "refused (508), no token counted; give the inference server's URL, or leave scrape.url unset "
                      "(proxy.upstream's)")
    # A relative path from a removed current folder names no place: every abspath and join of it (the run check below,
    # the lock, the bind) was a FileNotFoundError traceback or "No such file or directory". An absolute one needs none.
    placed = {"daemon.data_dir": values["daemon"]["data_dir"], "tags.socket": values["tags"]["socket"],
              **{k: v for k in ("proxy.listen", "metrics.listen") if str(v := values[k.split(".")[0]]["listen"])
                 .startswith("unix:")}}
    gone = [k for k, v in placed.items() if isinstance(v, str) and v and cwd_gone(v.removeprefix("unix:")) is not None]
    for key in gone:
        errors.append(f"config key {key} = {placed[key]!r}{came_from(key)}: the current folder no longer exists "
                      "(removed), so a relative path names no place. Fix: cd to one that does, or give an absolute path")
    if "daemon.data_dir" in gone:
        pass
    elif (d := values["daemon"]["data_dir"]) and isinstance(d, str) and (why := _not_a_folder(Path(d))):
        errors.append(f"config key daemon.data_dir = {d!r}{came_from('daemon.data_dir')} is not a folder: {why}; "
                      "give a folder, or a path where one can be made")
    elif data_dir_checked and (why := _holds_a_run(there := Config(values, "").data_dir())) is not None:
        said = f"config key daemon.data_dir = {d!r}{came_from('daemon.data_dir')}" if d else f"the default data dir {there}"
        errors.append(f"{said} {why}")
    elif data_dir_checked and (why := _cannot_make_or_write(there, given=bool(d))) is not None:
        said = f"config key daemon.data_dir = {d!r}{came_from('daemon.data_dir')}" if d else f"the default data dir {there}"
        errors.append(f"{said}: {why}")
    if values["proxy"]["workers"] > 1 and str(values["proxy"]["listen"]).startswith("unix:"):
        errors.append("config key proxy.workers > 1 needs a TCP proxy.listen (host:port); a unix: socket is "
                      "served by the daemon itself (proxy.workers = 1)" + came_from("proxy.workers", "proxy.listen"))
    # A socket path past the kernel's sun_path (108 bytes with its NUL) passed --check ("config OK"); at start the proxy's
    # exited 1 and the tag socket's was logged while the daemon ran on with no tag API.
    # The paths given only: a default tag socket in a deep data dir is logged at start as before, the daemon running on.
    sockets = [("tags.socket", Path(values["tags"]["socket"]))] if values["tags"]["socket"] else []
    sockets += [(k, Path(str(values[k.split(".")[0]]["listen"])[5:])) for k in ("proxy.listen", "metrics.listen")
                if str(values[k.split(".")[0]]["listen"]).startswith("unix:")]
    for key, sock in sockets:
        if len(os.fsencode(sock)) > UNIX_PATH_MAX_BYTES:
            errors.append(f"config key {key}: the socket path {str(sock)[:60]!r}... is {len(os.fsencode(sock))} bytes, "
                          f"more than the {UNIX_PATH_MAX_BYTES} a unix socket's path may have"
                          + came_from(key) + "; give a shorter path")
    if (why := _serving_not_sampled(values["daemon"]["serving_gpus"], values["daemon"]["gpus"])) is not None:
        errors.append(f"config key daemon.serving_gpus = {values['daemon']['serving_gpus']!r}"
                      f"{came_from('daemon.serving_gpus', 'daemon.gpus')}: {why}")
    if values["daemon"]["flush_interval_s"] > values["daemon"]["compact_interval_s"]:
        errors.append(f"config key daemon.flush_interval_s = {values['daemon']['flush_interval_s']:g} must not exceed "
                      f"daemon.compact_interval_s = {values['daemon']['compact_interval_s']:g}"
                      + came_from("daemon.flush_interval_s", "daemon.compact_interval_s"))
    _raise_all(errors)
    return Config(values, ", ".join(sources))


_WILDCARDS = {"0.0.0.0", "::", ""}


def _same_address(a: str, b: str) -> bool:
    """Whether two listen addresses (HOST:PORT or unix:PATH; empty: none) would take the same one: the same unix
    socket, or one port (not 0, any free one) on hosts that meet: the same text, a wildcard (0.0.0.0, and `::`,
    dual-stack on Linux), or a name (it may resolve to the other). 127.0.0.1 and [::1] are two."""
    if not a or not b:
        return False
    if a.startswith("unix:") or b.startswith("unix:"):
        return a == b
    (ha, _, pa), (hb, _, pb) = a.rpartition(":"), b.rpartition(":")
    if pa != pb or int(pa or 0) == 0:
        return False
    ha, hb = ha.strip("[]").lower(), hb.strip("[]").lower()
    if ha == hb or ha in _WILDCARDS or hb in _WILDCARDS:
        return True

    def is_ip(h: str) -> bool:
        try:
            ipaddress.ip_address(h)
            return True
        except ValueError:
            return False

    return not (is_ip(ha) and is_ip(hb))


def _upstream_is_listen(upstream: str, listen: str) -> bool:
    """Whether a connection to the upstream URL would reach the proxy listening on `listen` (HOST:PORT), judged by the
    text alone (no DNS: a SIGHUP reload must not block): the same port, and a host that reaches the listening one.
    Connecting to 0.0.0.0 or :: reaches the loopback address of its family; `localhost` (and *.localhost) may be either
    loopback; a wildcard listen address takes every local one (0.0.0.0: IPv4's, `::`: both, dual-stack on Linux),
    this machine's own name too. Another name, or another loopback address (127.0.0.2), is another host."""
    if not upstream or not listen or listen.startswith("unix:"):
        return False
    try:
        u = urlsplit(upstream)
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return False
    l_host, _, l_port = listen.rpartition(":")
    if not l_port.isdigit() or int(l_port) != port:
        return False

    def reached(host: str) -> set[str]:
        """The addresses (or the name) a connection to `host` may reach."""
        host = host.strip("[]").lower().rstrip(".")
        if host == "localhost" or host.endswith(".localhost"):
            return {"127.0.0.1", "::1"}
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return {host}
        return {"127.0.0.1" if ip.version == 4 else "::1"} if ip.is_unspecified else {ip.compressed}

    to, own = reached(u.hostname or ""), socket.gethostname().lower()
    l_host = l_host.strip("[]").lower().rstrip(".")
    if l_host in ("0.0.0.0", "::"):
        v4 = {a for a in to if ":" not in a and _loopback_ip(a)}
        return bool(v4 or own in to or (l_host == "::" and "::1" in to))
    return bool(to & reached(l_host))


def _loopback_ip(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def _not_a_folder(d: Path) -> str | None:
    """Why `d` cannot be the daemon's data folder, found before it starts: it, or the nearest path above it that
    exists, is not a folder (`data_dir = "/etc/passwd"` passed --check and failed at start)."""
    there = d
    while not os.path.lexists(there) and there != there.parent:
        there = there.parent
    if os.path.isdir(there):
        return None
    return "it exists and is no folder" if there == d else f"{there} exists and is no folder"


def missing_parent_text(data_dir: Path) -> str:
    """Why a data dir given (not the default) is not made: its parent folder is missing. Said at --check and at start."""
    parent = cwd_joined(data_dir).parent
    return (f"its parent folder {parent} does not exist; not making a tree of folders from a path that may be mistyped "
            f"(daemon.data_dir, --data-dir). Fix: correct the path, or make that folder first (mkdir -p {parent}); the "
            "daemon makes the data dir in it (mode 0700)")


def _cannot_make_or_write(d: Path, given: bool) -> str | None:
    """Why this user could not make the data dir `d`, or write in it, found without writing anything: a name too long
    for the file system, a given one's missing parent (the default one's folders above are made), the folder (or the
    nearest one above that exists, where it is made) not writable. Each passed --check ("config OK"); the daemon then
    stopped at start or at its first write. None where it can. Judged for the user running the check (the daemon's
    user where it is run as that user: `sudo -u powerprof powerprof daemon --check`)."""
    # Judged from /: the daemon writes through its data dir's absolute path (service: Path(data_dir).absolute()).
    if (why := path_problem(d) or path_max_problem(d if cwd_gone(d) else cwd_joined(d), OUTPUT_DEPTH_BYTES)) is not None:
        return why
    there = cwd_joined(d)
    if not os.path.lexists(there):
        if given and not os.path.isdir(there.parent):
            return missing_parent_text(d)
        while not os.path.lexists(there) and there != there.parent:
            there = there.parent
    if os.access(there, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return None
    import pwd  # noqa: PLC0415

    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        user = f"uid {os.geteuid()}"
    made = "the data dir" if there == cwd_joined(d) else f"{there}, where the data dir would be made,"
    return (f"{made} is not writable by {user} (the user running this); the daemon could not write its datasets. Fix: "
            f"give a folder this user may write, or run the daemon as one who may (chown or chmod it)")


def check_user_note(euid: int | None = None, args: Sequence[str] = ()) -> str | None:
    """What `daemon --check` run as root cannot tell, said after "config OK": the data dir's writability (judged by
    os.access, `_cannot_make_or_write`) is root's, who writes through any folder's mode, not that of the user the
    daemon runs as (the unit's User=powerprof): a data dir only root may write passed as root and failed at start.
    Judged as that user only by running the check as it (its groups, ACLs and mounts are the kernel's to apply).
    `args`: the options this check was given, repeated in the command said (it said "with the same --config" where
    `--data-dir` was given)."""
    import shlex  # noqa: PLC0415

    if (os.geteuid() if euid is None else euid) != 0:
        return None
    return ("note: the data dir's writability was judged for root, who may write in any folder; where the daemon runs "
            "as another user (the systemd unit's User=powerprof) run the check as that user: "
            + shlex.join(["sudo", "-u", "powerprof", "powerprof", "daemon", "--check", *args]))


UNIX_PATH_MAX_BYTES = 107  # Linux's sun_path is 108 bytes, its last the NUL


def _holds_a_run(d: Path) -> str | None:
    """Why `d` cannot be the daemon's data folder: a sweep's run is in it (`--data-dir` a copy of one passed --check
    and started, then `analyze` of the folder showed the daemon's summary in the run's stead, `export` the run's tables
    without the daemon's), or it is inside a run's folder (`--data-dir RUN/analysis`: `analyze RUN` wrote its report
    among the daemon's datasets, and `export` of them read analysis.parquet in their stead). None where neither."""
    if holds_sweep_run(d):
        found = [m for m in RUN_MARKS if (d / m).is_file()]
        return (f"holds a sweep's run ({', '.join(found)}): the daemon's datasets beside its tables would make "
                "`analyze` and `export` of that folder read one and leave the other out; give the daemon a folder of "
                "its own")
    # abspath, not resolve: the folder may not exist yet (made at start), and a symlinked run is the run. Only a run's
    # analysis folder is `analyze`'s (RUN/node1 is read by no command of the run's), and only a run powerprof wrote:
    # another tool's run.json in a home folder refused the daemon's default data dir below it.
    d_abs = Path(os.path.abspath(d))
    for above in d_abs.parents:
        report = above / "analysis"
        if (d_abs == report or report in d_abs.parents) and is_powerprof_run(above):
            found = [m for m in RUN_MARKS if (above / m).is_file()]
            return (f"is inside a sweep's run folder's analysis, {report} ({', '.join(found)} in {above}): `analyze` "
                    f"of that run writes its report there, beside any datasets, and `export` of them reads the "
                    "report's analysis.parquet in their stead; give the daemon a folder of its own, outside it")
    return None


def example_toml() -> str:
    """The annotated example config, generated from SPEC so the two cannot drift."""
    lines = ["# powerprof daemon configuration. Every key is optional; shown with its default.",
             "# Environment overrides: POWERPROF_<SECTION>_<KEY>, e.g. POWERPROF_PROXY_UPSTREAM.", ""]
    for section, keys in SPEC.items():
        lines.append(f"[{section}]")
        for key, spec in keys.items():
            if spec.help:
                lines.append(f"# {spec.help}{' (reloaded on SIGHUP)' if spec.reloadable else ''}")
            lines.append(f"{key} = {_toml_value(spec.default)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)
