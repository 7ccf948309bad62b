"""`powerprof monitor` as nvitop shows a GPU (issue 15, item 9): name, memory used/total, bars, load
and temperature in colour, readable without colour; plain lines and JSON lines for scripts."""

from __future__ import annotations

import io
import json

import pytest

from click.testing import CliRunner
from rich.console import Console

from powerprof import monitor as mon
from powerprof.cli import main


def _gpu(**kw) -> dict:
    g = {"device": "gpu0", "name": "NVIDIA H200", "mem_used_bytes": 30 * 2**30, "mem_total_bytes": 141 * 2**30,
         "power_w": 560.0, "power_avg_w": 540.0, "energy_j": 1234.5, "sm_clock_mhz": 1980.0,
         "mem_clock_mhz": 3201.0, "gpu_util_pct": 95.0, "mem_util_pct": 40.0, "temperature_c": 86.0,
         "enforced_limit_w": 700.0, "reasons": ["SwPowerCap"]}
    g.update(kw)
    return g


def _rows(*gpus) -> dict:
    return {"gpus": list(gpus), "cpus": [{"device": "package-0", "kind": "package", "power_w": 80.0, "energy_j": 9.0}],
            "host": {"cpu_util_pct": 12.0, "cpu_freq_mhz": 3000.0}}


def _text(renderable, width=80, color=False) -> str:
    c = Console(width=width, file=io.StringIO(), record=True, color_system="truecolor" if color else None,
                force_terminal=color)
    c.print(renderable)
    return c.export_text(styles=color)


def test_panel_shows_name_memory_and_bars_in_80_columns():
    text = _text(mon.render(3, _rows(_gpu()), 1.0))
    assert "NVIDIA H200" in text and "30.0 / 141.0 GiB" in text
    assert "UTIL" in text and "MEM" in text and "PWR" in text and "560.0 / 700 W" in text
    assert "temp 86°C" in text and "SwPowerCap" in text and "package-0 80.0 W" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_bars_read_without_colour():
    assert mon.bar(50, 10).plain == "█████░░░░░"
    assert mon.bar(None, 4).plain == "░░░░"  # unknown: empty, never a made-up value
    assert mon.bar(250, 4).plain == "████"  # clamped


def test_load_and_temperature_colours():
    assert mon.level_style(20, mon.LOAD_LEVELS) == "green"
    assert mon.level_style(65, mon.LOAD_LEVELS) == "yellow"
    assert mon.level_style(95, mon.LOAD_LEVELS) == "red"
    assert mon.level_style(40, mon.TEMP_LEVELS_C) == "green"
    assert mon.level_style(86, mon.TEMP_LEVELS_C) == "red"
    hot = _text(mon.gpu_panel(_gpu()), color=True)
    cool = _text(mon.gpu_panel(_gpu(temperature_c=40.0, gpu_util_pct=5.0)), color=True)
    red, green = "\x1b[31m", "\x1b[32m"
    assert red in hot and (red + "86°C") in hot
    assert (green + "40°C") in cool


def test_many_gpus_fall_back_to_the_compact_table():
    rows = _rows(*[_gpu(device=f"gpu{i}") for i in range(mon.MAX_PANELS + 1)])
    text = _text(mon.render(0, rows, 1.0), width=120)
    assert "╭" not in text and "gpu4" in text


def test_monitor_json_lines_for_scripts():
    r = CliRunner().invoke(main, ["monitor", "--simulate", "--duration", "0.4", "--interval", "0.2", "--json"])
    assert r.exit_code == 0, r.output
    objs = [json.loads(line) for line in r.output.splitlines() if line.startswith("{")]
    assert len(objs) >= 2
    g = objs[-1]["gpus"][0]
    assert {"name", "mem_used_bytes", "mem_total_bytes", "power_w", "temperature_c", "gpu_util_pct"} <= set(g)
    assert g["name"].startswith("Simulated") and g["mem_total_bytes"] > 0
    assert objs[-1]["t_s"] > objs[0]["t_s"]


def test_monitor_plain_lines():
    r = CliRunner().invoke(main, ["monitor", "--simulate", "--duration", "0.2", "--interval", "0.2", "--plain"])
    assert r.exit_code == 0, r.output
    assert "gpu0 power=" in r.output and "╭" not in r.output


def test_a_lost_gpus_note_is_shown_in_every_view_and_the_table_keeps_its_columns():
    from powerprof.collectors.nvml import NvmlCollector
    from powerprof.collectors.sampler import Sample
    from powerprof.sim.faults import FaultyNVML
    from powerprof.sim.nvml import SimNVML

    nv = FaultyNVML(SimNVML(count=5, state_path=None))
    c = NvmlCollector(nv, list(range(5)))
    nv.lose(1)
    rows = mon.display_rows({"nvml": Sample("nvml", 0, 0, 0, c.read())}, {}, {i.index: i for i in c.infos})
    assert "nvidia-smi -r -i 1" in mon.lines(0, rows, 1.0)[1]
    assert "GPU_IS_LOST" in json.loads(mon.json_line(0, rows, 1.0))["gpus"][1]["note"]
    table = _text(mon.render(0, rows, 1.0), width=100)
    assert "gpu1: the GPU fell off the bus" in table and " gpu0   " in table and "GpuIdle" in table
    two = dict(rows, gpus=rows["gpus"][:2])
    assert "GPU_IS_LOST" in _text(mon.render(0, two, 1.0), width=100)


def test_a_rapl_zones_note_is_shown_and_energy_after_a_dropped_delta_is_a_lower_bound(tmp_path):
    # A stub package counter showed "package-0 - W (- J)" with no reason, and after a dropped delta the
    # energy since start (short of the dropped span) looked complete.
    from powerprof.collectors.rapl import RaplCollector
    from powerprof.collectors.sampler import Sample
    from powerprof.sim.powercap import SimPowercap

    t = [5_000_000_000]
    watts = [40.0]
    pc = SimPowercap(tmp_path / "pc", clock_ns=lambda: t[0], power_w_fn=lambda: watts[0], dram=False)
    rc = RaplCollector(pc.root, clock_ns=lambda: t[0])
    base: dict = {}

    def tick(dt):
        t[0] += int(dt * 1e9)
        pc.update()
        return mon.display_rows({"rapl": Sample("rapl", 0, 0, 0, rc.read())}, base)

    tick(0.0)
    ok = tick(1.0)
    assert "≥" not in mon.lines(1, ok, 1.0)[0] and ok["cpus"][0]["note"] is None
    watts[0] = 0.0  # the counter stands still
    pc.update()
    stuck = tick(0.5)
    line = mon.lines(2, stuck, 1.0)[0]
    assert "package-0 - (-) note: counter unmoved" in line
    assert "counter unmoved" in json.loads(mon.json_line(2, stuck, 1.0))["cpus"][0]["note"]
    watts[0] = 40.0
    pc.update()
    tick(0.5)
    after = tick(1.0)
    assert after["cpus"][0]["energy_lower_bound"] is True
    assert "(≥80.0 J)" in mon.lines(3, after, 1.0)[0]  # 20 J of the resumed span dropped


@pytest.mark.parametrize("width", [40, 50, 60])
def test_a_narrow_terminal_never_parts_a_figure_from_its_unit(width):
    # The panel's foot and the CPU line wrapped at any space: "SM 1980" on one line and "MHz" on the next.
    text = _text(mon.render(3, _rows(_gpu()), 1.0), width=width)
    lines = text.splitlines()
    g = _gpu()
    for whole in (f"SM {g['sm_clock_mhz']:.0f} MHz", f"mem {g['mem_clock_mhz']:.0f} MHz", f"energy {g['energy_j']:.1f} J",
                  "package-0 80.0 W", "CPU util 12% @ 3000 MHz"):
        assert any(whole in line for line in lines), (whole, text)
