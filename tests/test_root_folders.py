"""Root writes only in folders no one else can write (docs/safety.md, the trust table): `measure --out` and
`monitor --recover` as `sweep --out` does; another user's folder is simulated with a folder chowned to uid 65534."""

from __future__ import annotations

import os
import sys

import pytest
from click.testing import CliRunner

from powerprof.cli import main

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="the refusal is root's: as another user the folder is "
                                                       "that user's own, and only root can chown it to uid 65534")


def _theirs(tmp_path, mode=0o755):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=mode)
    os.chmod(theirs, mode)
    os.chown(theirs, 65534, 65534)
    return theirs


@AS_ROOT
def test_measure_as_root_refuses_another_users_folder_before_it_launches_anything(tmp_path, monkeypatch):
    # Before: `sudo powerprof measure --out DIR` (sudo for RAPL, docs/collectors.md) made DIR and wrote windows.parquet
    # and run.json wherever DIR was, and launched the --launch server; in a folder of uid 65534's, they could plant a
    # symlink where root writes by a name known in advance, or swap the run folder itself.
    monkeypatch.delenv("SUDO_UID", raising=False)
    theirs = _theirs(tmp_path)
    marker = tmp_path / "launched"
    r = CliRunner().invoke(main, ["measure", "--server", "http://127.0.0.1:9", "--launch",
                                  f"{sys.executable} -c \"open('{marker}', 'w')\"", "--launch-timeout", "5",
                                  "--requests", "1", "--out", str(theirs / "run")])
    assert r.exit_code == 1, r.output
    assert "refusing to write there as root" in r.output and "owned by uid 65534" in r.output, r.output
    assert list(theirs.iterdir()) == [] and not marker.exists()  # nothing made, nothing launched


@AS_ROOT
def test_measure_as_root_writes_in_the_sudo_users_folder_but_never_in_one_others_can_write(tmp_path, monkeypatch):
    theirs = _theirs(tmp_path)
    monkeypatch.setenv("SUDO_UID", "65534")  # they ran `sudo powerprof measure` from their home: their choice
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g", "--requests", "1", "--warmup", "0",
                                  "--max-tokens", "8", "--out", str(theirs / "run")])
    assert r.exit_code == 0, r.output
    assert (theirs / "run" / "windows.parquet").exists()
    os.chmod(theirs, 0o777)  # whoever owns it, a folder anyone can write is no one's choice
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g", "--requests", "1", "--warmup", "0",
                                  "--max-tokens", "8", "--out", str(theirs / "run2")])
    assert r.exit_code == 1 and "writable by group or others" in r.output, r.output
    assert not (theirs / "run2").exists()


def _killed_monitor_parts(folder):
    """The FILE.parts/ folder a killed `monitor --output FILE` leaves: one part (no rows: enough to combine)."""
    from powerprof.storage.samples import parts_dir_for, write_table
    from powerprof.storage.schema import SAMPLES, rows_to_table

    parts = parts_dir_for(folder / "m.parquet")
    parts.mkdir()
    write_table(rows_to_table(SAMPLES, []), parts / "part-000001.parquet", {})
    return parts


def test_monitor_recover_follows_no_symlink_planted_as_its_lock(tmp_path):
    # Before: recover opened FILE.parts/.lock with O_CREAT, following a symlink planted there: as root, an empty
    # root-owned file created (or an existing one opened for writing) anywhere on the machine.
    parts = _killed_monitor_parts(tmp_path)
    victim = tmp_path / "victim"
    os.symlink(victim, parts / ".lock")
    r = CliRunner().invoke(main, ["monitor", "--recover", str(tmp_path / "m.parquet")])
    assert r.exit_code == 1 and ".lock" in r.output and "symlink" in r.output, r.output
    assert not victim.exists() and not os.path.lexists(tmp_path / "m.parquet")
    assert os.path.islink(parts / ".lock")  # the parts kept, as they were


@AS_ROOT
def test_monitor_recover_as_root_refuses_parts_in_another_users_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("SUDO_UID", raising=False)
    theirs = _theirs(tmp_path)
    parts = _killed_monitor_parts(theirs)
    before = sorted(p.name for p in parts.iterdir())
    r = CliRunner().invoke(main, ["monitor", "--recover", str(theirs / "m.parquet")])
    assert r.exit_code == 2 and "refusing to write there as root" in r.output, r.output
    assert "owned by uid 65534" in r.output, r.output
    assert sorted(p.name for p in parts.iterdir()) == before and not os.path.lexists(theirs / "m.parquet")
    monkeypatch.setenv("SUDO_UID", "65534")  # the user who ran sudo: their own folder
    r = CliRunner().invoke(main, ["monitor", "--recover", str(theirs / "m.parquet")])
    assert r.exit_code == 0, r.output
    assert (theirs / "m.parquet").exists() and not parts.exists()
    # And `monitor --output FILE` as root (sudo for RAPL) makes FILE.parts/ and FILE there: the same rule.
    monkeypatch.delenv("SUDO_UID")
    r = CliRunner().invoke(main, ["monitor", "--simulate", "seed-16g", "--duration", "0.1", "--plain",
                                  "--output", str(theirs / "n.parquet")])
    assert r.exit_code == 2 and "refusing to write there as root" in r.output, r.output
    assert not os.path.lexists(theirs / "n.parquet.parts") and not os.path.lexists(theirs / "n.parquet")
