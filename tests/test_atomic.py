"""Atomic replacement and the privilege check shared by storage, analysis, control and the daemon."""

from __future__ import annotations

import pytest

from powerprof import privilege
from powerprof.storage.atomic import atomic_path, atomic_write_bytes


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    out = tmp_path / "out"  # tmp_path also holds the isolated state folder
    out.mkdir()
    target = out / "report.md"
    atomic_write_bytes(target, b"old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("writer died")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in out.iterdir()) == ["report.md"]


def test_a_clean_write_replaces_the_file_through_a_hidden_temporary(tmp_path):
    out = tmp_path / "out"  # tmp_path also holds the isolated state folder
    out.mkdir()
    target = out / "run.json"
    target.write_bytes(b"old")
    with atomic_path(target) as tmp:
        assert tmp.parent == out and tmp.name.startswith(".run.json.") and tmp.name.endswith(".tmp")
        assert not tmp.exists() and target.read_bytes() == b"old"
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]


def test_a_fixed_temporary_name_is_used_as_given(tmp_path):
    with atomic_path(tmp_path / "part-1.parquet", tmp_name=".part-1.parquet.tmp") as tmp:
        assert tmp == tmp_path / ".part-1.parquet.tmp"
        tmp.write_bytes(b"x")
    assert (tmp_path / "part-1.parquet").read_bytes() == b"x"


@pytest.mark.parametrize("capeff, expected", [("0000000000200000", True), ("00000000001fffff", False), ("garbage", False)])
def test_cap_sys_admin_is_read_from_the_effective_set(tmp_path, monkeypatch, capeff, expected):
    monkeypatch.setattr(privilege.os, "geteuid", lambda: 1000)
    status = tmp_path / "status"
    status.write_text(f"Name:\tpython\nCapInh:\t0000000000200000\nCapEff:\t{capeff}\n")
    assert privilege.has_admin_privilege(str(status)) is expected


def test_root_needs_no_capability_and_a_missing_status_file_means_no(tmp_path, monkeypatch):
    monkeypatch.setattr(privilege.os, "geteuid", lambda: 0)
    assert privilege.has_admin_privilege(str(tmp_path / "absent")) is True
    monkeypatch.setattr(privilege.os, "geteuid", lambda: 1000)
    assert privilege.has_admin_privilege(str(tmp_path / "absent")) is False
