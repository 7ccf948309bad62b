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


# --- workload: measure (inference-server clients, simulated server, launcher) ------------------


def _int_list(ctx, param, value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers like 1,4 — got {value!r}") from None
    if not out or any(v < 1 for v in out):
        raise click.BadParameter("every concurrency must be at least 1")
    return out


@main.command()
@click.option("--server", "url", metavar="URL", help="Inference server base URL, e.g. http://127.0.0.1:8080.")
@simulate_option
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Output directory (default runs/<time>-measure).")
@click.option("--api", type=click.Choice(["llamacpp", "openai-completions", "openai-chat"]), help="Protocol; default detected.")
@click.option("--requests", "n_requests", type=click.IntRange(1), default=8, show_default=True, help="Measured requests per concurrency.")
@click.option("--concurrency", default="1", callback=_int_list, show_default=True, help="Streams at once, e.g. 1,4.")
@click.option("--max-tokens", type=click.IntRange(2), default=128, show_default=True, help="Tokens per request (ignore-EOS where supported).")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), help="JSONL file: {\"prompt\": ...} per line.")
@click.option("--prompt-set", type=click.Choice(["short", "medium", "long", "mixed"]), default="short", show_default=True)
@click.option("--warmup", type=click.IntRange(0), default=1, show_default=True, help="Warm-up requests (recorded, flagged, not counted).")
@click.option("--prompt-cache/--no-prompt-cache", default=False, show_default=True, help="Let llama.cpp reuse cached prompt prefixes.")
@click.option("--seed", type=int, default=42, show_default=True)
@click.option("--keep-text", is_flag=True, help="Store prompt and completion text in windows.parquet.")
@click.option("--launch", metavar="CMD", help="Start the server with CMD, wait for /health, stop it at the end.")
@click.option("--launch-timeout", type=click.FloatRange(1), default=300.0, show_default=True, help="Seconds to wait for /health.")
def measure(url, simulate, out_dir, api, n_requests, concurrency, max_tokens, prompts_file, prompt_set, warmup,
            prompt_cache, seed, keep_text, launch, launch_timeout):
    """J/token and decode tok/s at the current settings. Changes nothing; needs no root."""
    import sys
    from pathlib import Path

    from powerprof.storage.runs import default_run_dir
    from powerprof.workload.client import RequestParams, ServerUnreachable
    from powerprof.workload.launcher import LaunchError
    from powerprof.workload.load import PromptFileError, builtin_prompts, load_prompts
    from powerprof.workload.measure import run_measure

    if bool(url) == bool(simulate):
        raise click.UsageError("give exactly one of --server URL or --simulate")
    if launch and not url:
        raise click.UsageError("--launch needs --server URL (where the launched server will listen)")
    try:
        prompts = load_prompts(prompts_file) if prompts_file else builtin_prompts(prompt_set)
    except PromptFileError as e:
        raise click.UsageError(str(e)) from None
    out = Path(out_dir) if out_dir else default_run_dir(Path("runs"), "measure")
    params = RequestParams(max_tokens=max_tokens, seed=seed, prompt_cache=prompt_cache, keep_text=keep_text)
    try:
        res = run_measure(url=url, simulate=simulate, out_dir=out, prompts=prompts, n_requests=n_requests,
                          concurrencies=concurrency, params=params, warmup=warmup, api=api, launch=launch,
                          launch_timeout_s=launch_timeout, command_line=" ".join(sys.argv))
    except (ServerUnreachable, LaunchError, FileExistsError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    s = res.server
    click.echo(f"server: {s.kind} ({s.api}) model={s.model} build={s.build_info}" + (" [simulated]" if s.simulated else ""))
    for note in res.notes:
        click.echo(f"note: {note}")

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    click.echo(f"{'concurrency':>11} {'ok':>4} {'failed':>6} {'decode tok/s':>12} {'GPU J/tok':>10} {'GPU+CPU J/tok':>13}  method")
    for m in res.summaries:
        click.echo(f"{m.concurrency:>11} {m.n_ok:>4} {m.n_failed:>6} {fmt(m.decode_tok_s, '12.1f')} "
                   f"{fmt(m.gpu_j_per_token, '10.3f')} {fmt(m.total_j_per_token, '13.3f')}  {m.energy_method}")
    click.echo(f"windows: {res.out_path / 'windows.parquet'}")
    if res.aborted:
        raise click.ClickException(f"stopped early: {res.aborted} (what was measured is in {res.out_path})")


if __name__ == "__main__":
    main()
