"""Command line: thin click commands that wire the layers together and print results."""

from __future__ import annotations

import click

from powerprof import __version__
from powerprof.sim.profiles import DEFAULT_PROFILE, PROFILES

SIMULATE_HELP = f"Use a simulated GPU (profiles: {', '.join(PROFILES)}; default {DEFAULT_PROFILE})."


def simulate_option(f):
    return click.option(
        "--simulate",
        "simulate",
        is_flag=False,
        flag_value=DEFAULT_PROFILE,
        default=None,
        type=click.Choice(sorted(PROFILES)),
        help=SIMULATE_HELP,
    )(f)


@click.group()
@click.version_option(__version__, prog_name="powerprof")
def main() -> None:
    """Power and efficiency profiler for GPUs serving LLMs."""


# --- daemon (issue 7): always-on sampling, tagging proxy, Prometheus, tag API -----------------


@main.command("daemon")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config file.")
@simulate_option
@click.option("--sim-gpus", type=click.IntRange(1, 64), default=1, show_default=True, help="Simulated GPU count.")
@click.option("--listen", help="Proxy address HOST:PORT (proxy.listen).")
@click.option("--upstream", help="Inference server URL behind the proxy (proxy.upstream).")
@click.option("--metrics-listen", help="Prometheus /metrics address (metrics.listen).")
@click.option("--data-dir", help="Dataset folder (daemon.data_dir).")
@click.option("--interval", type=float, help="Sampling period in seconds (daemon.interval_s).")
@click.option("--flush-interval", type=float, help="Seconds between Parquet flushes (daemon.flush_interval_s).")
@click.option("--tag-socket", help="Tag API Unix socket (tags.socket).")
@click.option("--print-config", is_flag=True, help="Print the example config with every key and exit.")
@click.option("--check", is_flag=True, help="Validate the config and exit.")
def daemon_cmd(config_path, simulate, sim_gpus, listen, upstream, metrics_listen, data_dir, interval,
               flush_interval, tag_socket, print_config, check):
    """Always-on sampling, traffic-tagging proxy, crash-safe Parquet and Prometheus /metrics."""
    import sys

    from powerprof.daemon import config as dconfig
    from powerprof.daemon import service

    if print_config:
        click.echo(dconfig.example_toml())
        return
    overrides = {
        "proxy.listen": listen, "proxy.upstream": upstream, "metrics.listen": metrics_listen,
        "daemon.data_dir": data_dir, "daemon.interval_s": interval, "daemon.flush_interval_s": flush_interval,
        "tags.socket": tag_socket,
    }
    try:
        cfg = dconfig.load_config(config_path, overrides=overrides)
    except dconfig.ConfigError as e:
        click.echo(f"powerprof daemon: {e}", err=True)
        sys.exit(service.EXIT_CONFIG)
    if check:
        click.echo(f"config OK ({cfg.source})")
        return
    from powerprof.collectors.nvml import open_nvml

    try:
        nvml = open_nvml(simulate=simulate, count=sim_gpus)
    except Exception as e:
        click.echo(f"powerprof daemon: cannot load NVML: {e}", err=True)
        sys.exit(service.EXIT_RUNTIME)
    sys.exit(service.main(cfg, nvml, config_path=config_path, overrides=overrides, simulate=bool(simulate)))


@main.group("tag")
def tag_group() -> None:
    """Application-defined windows in the running daemon (its tag API)."""


def _tag_socket(socket, config_path):
    from powerprof.daemon import config as dconfig

    if socket:
        return socket
    try:
        return dconfig.load_config(config_path).tag_socket()
    except dconfig.ConfigError as e:
        raise click.ClickException(str(e))


def _tag_call(action, name, socket, config_path):
    from powerprof.daemon.tagapi import TagApiError, send_tag

    try:
        return send_tag(_tag_socket(socket, config_path), action, name)
    except (TagApiError, ValueError) as e:
        raise click.ClickException(str(e))


_tag_opts = [
    click.option("--socket", help="The daemon's tag socket (default: from the config)."),
    click.option("--config", "config_path", type=click.Path(dir_okay=False), help="The daemon's TOML config."),
]


def _with_tag_opts(f):
    for o in reversed(_tag_opts):
        f = o(f)
    return f


@tag_group.command("start")
@click.argument("name")
@_with_tag_opts
def tag_start(name, socket, config_path):
    """Open the window NAME now."""
    _tag_call("start", name, socket, config_path)
    click.echo(f"tag {name} started")


@tag_group.command("stop")
@click.argument("name")
@_with_tag_opts
def tag_stop(name, socket, config_path):
    """Close the window NAME and print its energy."""
    r = _tag_call("stop", name, socket, config_path)
    jpt = r.get("gpu_j_per_token")
    click.echo(
        f"tag {name}: {r.get('duration_s') or 0:.2f} s, GPU {r.get('gpu_energy_j') or 0:.1f} J, "
        f"{r.get('proxy_tokens') or 0:.0f} tokens" + (f", {jpt:.3f} J/token" if jpt else "")
    )


@tag_group.command("list")
@_with_tag_opts
def tag_list(socket, config_path):
    """List open windows."""
    for n in _tag_call("list", None, socket, config_path).get("open", []):
        click.echo(n)


if __name__ == "__main__":
    main()
