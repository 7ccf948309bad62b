"""Atomic replacement and the privilege check shared by storage, analysis, control and the daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

from powerprof import privilege
from powerprof.storage import atomic
from powerprof.storage.atomic import atomic_group, atomic_path, atomic_write_bytes


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


def test_a_fifo_or_device_is_never_replaced_by_the_file(tmp_path):
    # Whatever a caller checked at its start: a FIFO (or a device) there by the rename is kept, FileExistsError
    # raised as for a file made meanwhile, no temporary left. `trace /dev/null --force` made it a regular file.
    import os
    import stat

    os.mkfifo(tmp_path / "pipe")
    os.mknod(tmp_path / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    for name in ("pipe", "null"):
        before = os.lstat(tmp_path / name)
        with pytest.raises(FileExistsError):
            atomic_write_bytes(tmp_path / name, b"data")
        after = os.lstat(tmp_path / name)
        assert (after.st_mode, after.st_rdev, after.st_ino) == (before.st_mode, before.st_rdev, before.st_ino)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def _group_of_three(out, new=b"new"):
    with atomic_group() as stage:
        for name in ("analysis.parquet", "report.md", "report.html"):
            stage(out / name).write_bytes(new)


def test_a_group_whose_rename_fails_part_way_puts_the_renamed_files_back(tmp_path, monkeypatch):
    # report.md was replaced, report.html's rename failed (EIO): the folder held a new report beside the old
    # analysis.json, and the temporaries stayed. Now every file is the old one, and nothing else is there.
    from support import eio_on_replace_to

    out = tmp_path / "out"
    out.mkdir()
    _group_of_three(out, b"old")
    eio_on_replace_to(monkeypatch, "report.html")
    with pytest.raises(OSError):
        _group_of_three(out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {
        "analysis.parquet": b"old", "report.md": b"old", "report.html": b"old"}


def test_a_group_with_a_folder_where_a_file_goes_renames_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _group_of_three(out, b"old")
    (out / "report.html").unlink()
    (out / "report.html").mkdir()
    with pytest.raises(IsADirectoryError):
        _group_of_three(out)
    assert sorted(p.name for p in out.iterdir()) == ["analysis.parquet", "report.html", "report.md"]
    assert (out / "analysis.parquet").read_bytes() == b"old" and (out / "report.md").read_bytes() == b"old"


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


def test_a_group_removes_the_files_given_with_its_renames_and_puts_them_back_on_a_failure(tmp_path, monkeypatch):
    import errno
    import os

    out = tmp_path / "out"
    out.mkdir()
    _group_of_three(out, b"old")
    with atomic_group() as stage:
        stage(out / "report.html").write_bytes(b"new")
        stage.remove(out / "report.md")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {"analysis.parquet": b"old", "report.html": b"new"}
    (out / "report.md").write_bytes(b"old")
    real = os.replace

    def fail_on_parquet(src, dst):
        if str(dst).endswith("analysis.parquet") and str(src).endswith(".tmp"):
            raise OSError(errno.EPERM, "Operation not permitted")
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", fail_on_parquet)
    with pytest.raises(OSError) as e:
        with atomic_group() as stage:
            stage(out / "report.html").write_bytes(b"newer")
            stage(out / "analysis.parquet").write_bytes(b"newer")
            stage.remove(out / "report.md")
    # The error named the temporary, gone by then; now the file whose rename failed.
    assert e.value.filename == str(out / "analysis.parquet")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {
        "analysis.parquet": b"old", "report.html": b"new", "report.md": b"old"}


def _mixed_by_a_failed_put_back(tmp_path, monkeypatch, rename_error: BaseException):
    """(the folder, the GroupMixed raised) of a group of three over an old one whose report.html rename raised
    `rename_error` and whose put-back of the old report.md failed (EIO) too."""
    import errno
    import os

    out = tmp_path / "out"
    out.mkdir()
    _group_of_three(out, b"old")
    real, into = os.replace, []

    def replace(src, dst):
        into.append(Path(dst).name)
        if Path(dst).name == "report.html":
            raise rename_error
        if into[-1] == "report.md" and into.count("report.md") == 2:  # its put-back
            raise OSError(errno.EIO, "Input/output error", str(dst))
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(atomic.GroupMixed) as e:
        _group_of_three(out)
    return out, e


def test_a_group_whose_put_back_fails_too_says_the_folder_is_mixed_file_by_file(tmp_path, monkeypatch):
    # report.html's rename failed (EIO) and putting the old report.md back failed as well: the error said only
    # "report.html: Input/output error", and the folder held a new report.md beside the old analysis.parquet unsaid.
    import errno

    out, e = _mixed_by_a_failed_put_back(tmp_path, monkeypatch, OSError(errno.EIO, "Input/output error",
                                                                          str(tmp_path / "out" / "report.html")))
    assert (e.value.new, e.value.old, e.value.missing) == ([out / "report.md"], [out / "analysis.parquet",
                                                                                 out / "report.html"], [])
    said = str(e.value)
    assert "MIXED" in said and f"new: {out / 'report.md'}" in said and "old: " in said and "report.html" in said, said
    assert "Fix:" in said, said
    # Nothing else deleted: the new report.md stays, the old ones are whole, and report.md's old content is kept.
    files = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")}
    assert files == {"analysis.parquet": b"old", "report.md": b"new", "report.html": b"old"}
    kept = [p for p in out.iterdir() if p.name.startswith(".")]
    assert [p.read_bytes() for p in kept] == [b"old"] and str(kept[0]) in said, said


def test_a_group_whose_rename_fails_with_no_oserror_and_whose_put_back_fails_says_the_folder_is_mixed(tmp_path,
                                                                                                         monkeypatch):
    # A rename failing with another exception (MemoryError here) while a put-back failed too raised that exception
    # alone: the new report.md beside the old files, and its kept old content, unsaid.
    out, e = _mixed_by_a_failed_put_back(tmp_path, monkeypatch, MemoryError("no memory for the rename"))
    said = str(e.value)
    assert e.value.new == [out / "report.md"] and "MIXED" in said and "MemoryError" in said, said
    assert f"{out / 'report.html'}: MemoryError: no memory for the rename" in said, said
    assert isinstance(e.value.__cause__, MemoryError)
    assert [p.read_bytes() for p in out.iterdir() if p.name.startswith(".")] == [b"old"]


def test_a_group_whose_removal_cannot_be_put_back_says_the_file_is_missing(tmp_path, monkeypatch):
    import errno
    import os

    out = tmp_path / "out"
    out.mkdir()
    _group_of_three(out, b"old")
    real_replace, real_unlink = os.replace, os.unlink

    def unlink(path, *a, **k):
        if Path(path).name == "report.html":
            raise OSError(errno.EPERM, "Operation not permitted", str(path))
        return real_unlink(path, *a, **k)

    def replace(src, dst):
        if Path(dst).name == "report.md":
            raise OSError(errno.EIO, "Input/output error", str(dst))  # the put-back of the removed report.md
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "unlink", unlink)
    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(atomic.GroupMixed) as e:
        with atomic_group() as stage:
            stage(out / "analysis.parquet").write_bytes(b"new")
            stage.remove(out / "report.md")
            stage.remove(out / "report.html")
    assert (e.value.new, e.value.missing) == ([], [out / "report.md"]), str(e.value)
    assert e.value.old == [out / "analysis.parquet", out / "report.html"], str(e.value)
    assert f"missing: {out / 'report.md'}" in str(e.value)


def test_a_group_refuses_a_path_staged_twice(tmp_path):
    # report._staged_png staged power_clock_r-1.png twice for runs 'r.1' and 'r-1': the group renamed both, the first
    # version's put-back link and a hard-linked temporary stayed, and a failed later rename put back new1, not the
    # old file. A path staged twice is a caller's bug: refused at once, nothing replaced, no temporary left.
    out = tmp_path / "out"
    out.mkdir()
    (out / "p.png").write_bytes(b"old")
    with pytest.raises(ValueError, match="staged twice"):
        with atomic_group() as stage:
            stage(out / "p.png").write_bytes(b"new1")
            stage(out / "p.png").write_bytes(b"new2")
    with pytest.raises(ValueError, match="staged twice"):
        with atomic_group() as stage:
            stage(out / "p.png").write_bytes(b"new1")
            stage.remove(out / "p.png")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {"p.png": b"old"}
