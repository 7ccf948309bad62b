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


@pytest.fixture
def alice(monkeypatch):
    """uid 65534 seen as alice, with her user-private group (gid 65534, named alice, no other member), as useradd makes
    on Ubuntu and Fedora: the passwd and group entries are faked (here 65534 is nobody, whose nogroup is shared)."""
    import grp
    import pwd

    real_pw, real_gr = pwd.getpwuid, grp.getgrgid
    monkeypatch.setattr(pwd, "getpwuid", lambda u: pwd.struct_passwd(("alice", "x", 65534, 65534, "", "/home/alice",
                                                                      "/bin/sh")) if u == 65534 else real_pw(u))
    monkeypatch.setattr(grp, "getgrgid", lambda g: grp.struct_group(("alice", "x", 65534, [])) if g == 65534
                        else real_gr(g))
    # No one else has gid 65534 as their primary group (here sync and _apt have nogroup's: their passwd entries go).
    others = [pw for pw in pwd.getpwall() if pw.pw_uid != 65534 and pw.pw_gid != 65534]
    monkeypatch.setattr(pwd, "getpwall", lambda: [*others, pwd.getpwuid(65534)])
    return 65534


def _folder(path, uid, gid, mode):
    path.mkdir()
    os.chown(path, uid, gid)
    os.chmod(path, mode)
    return path


@AS_ROOT
def test_the_sudo_users_group_writable_folders_pass_when_the_group_is_their_own(tmp_path, monkeypatch, alice):
    # Before: under umask 002 with user-private groups (Ubuntu's and Fedora's default), ~/project is 0775, group the
    # user's own: `sudo powerprof sweep` (default ./runs) was refused "writable by group or others", though
    # docs/sweep.md says ./runs in the sudo user's home passes; and a user's own restore file under a 0775 ~/.local
    # was refused by `restore` after a crash.
    from powerprof.control.restore import untrusted_reason
    from powerprof.trust import untrusted_out_dir

    gid = alice
    home = _folder(tmp_path / "alice", 65534, gid, 0o750)
    project = _folder(home / "project", 65534, gid, 0o775)
    assert untrusted_out_dir(project / "runs" / "x", euid=0, env={"SUDO_UID": "65534"}) is None
    local = _folder(home / ".local", 65534, gid, 0o775)
    state = _folder(_folder(local / "state", 65534, gid, 0o700) / "powerprof", 65534, gid, 0o700)
    restore = state / "restore-x.json"
    restore.write_text("{}")
    os.chown(restore, 65534, gid)
    os.chmod(restore, 0o600)
    assert untrusted_reason(restore, euid=65534) is None
    # The command itself, as `sudo` runs it from alice's project.
    monkeypatch.setenv("SUDO_UID", "65534")
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g", "--requests", "1", "--warmup", "0",
                                  "--max-tokens", "8", "--out", str(project / "run")])
    assert r.exit_code == 0, r.output
    assert (project / "run" / "windows.parquet").exists()
    # Still refused: a group that is not the owner's private one, a private-looking group with another member,
    # anything world-writable, and group write for a user sudo did not name.
    shared = _folder(home / "shared", 65534, 100 if gid != 100 else 101, 0o775)
    assert "writable by group" in untrusted_out_dir(shared / "x", euid=0, env={"SUDO_UID": "65534"})
    import grp

    alices = grp.getgrgid
    for other in (("alice", "x", gid, ["bob"]), ("staff", "x", gid, [])):  # bob a member; not named as alice
        monkeypatch.setattr(grp, "getgrgid", lambda g, e=other: grp.struct_group(e) if g == gid else alices(g))
        assert "writable by group" in untrusted_out_dir(project / "x", euid=0, env={"SUDO_UID": "65534"})
    monkeypatch.setattr(grp, "getgrgid", alices)
    os.chmod(project, 0o777)
    assert "writable by group or others" in untrusted_out_dir(project / "x", euid=0, env={"SUDO_UID": "65534"})
    os.chmod(project, 0o775)
    assert "owned by uid 65534" in untrusted_out_dir(project / "x", euid=0, env={})
    # Root's own group never counts as private: RHEL's `operator` has gid 0 as its primary group.
    roots = _folder(tmp_path / "roots", 0, 0, 0o775)
    assert "writable by group" in untrusted_out_dir(roots / "x", euid=0, env={})


@AS_ROOT
def test_a_group_that_is_another_users_primary_group_is_not_private(tmp_path, monkeypatch, alice):
    # Before: alice's `alice` group (named as her, no member listed) passed as hers alone, but carol, whose passwd entry
    # has it as her primary group, is in it without being listed: she could write in alice's 0775 project, and plant a
    # symlink there that `sudo powerprof sweep` would follow. (On this machine: nogroup, sync's and _apt's primary.)
    import pwd

    from powerprof.trust import untrusted_out_dir

    project = _folder(_folder(tmp_path / "alice", 65534, alice, 0o750) / "project", 65534, alice, 0o775)
    sudo = {"SUDO_UID": "65534"}
    assert untrusted_out_dir(project / "runs", euid=0, env=sudo) is None  # hers alone: passes
    users = pwd.getpwall()
    carol = pwd.struct_passwd(("carol", "x", 65533, alice, "", "/home/carol", "/bin/sh"))
    monkeypatch.setattr(pwd, "getpwall", lambda: [*users, carol])
    why = untrusted_out_dir(project / "runs", euid=0, env=sudo)
    assert why and "writable by group" in why and "primary group" in why, why
    alias = pwd.struct_passwd(("alice2", "x", 65534, alice, "", "/home/alice", "/bin/sh"))  # her uid again: still hers
    monkeypatch.setattr(pwd, "getpwall", lambda: [*users, alias])
    assert untrusted_out_dir(project / "runs", euid=0, env=sudo) is None


@AS_ROOT
def test_the_primary_group_scan_fails_closed_and_runs_only_for_a_group_writable_folder(tmp_path, monkeypatch, alice):
    # The scan reads every passwd entry NSS lists: once per check at most, and not at all on the usual path (no folder
    # on the way group-writable). A passwd database that cannot be read refuses the group write, never allows it.
    import pwd

    from powerprof.trust import untrusted_out_dir

    home = _folder(tmp_path / "alice", 65534, alice, 0o755)
    calls = []
    users = pwd.getpwall()
    monkeypatch.setattr(pwd, "getpwall", lambda: calls.append(1) or users)
    plain = _folder(home / "plain", 65534, alice, 0o755)
    assert untrusted_out_dir(plain / "a" / "b", euid=0, env={"SUDO_UID": "65534"}) is None and calls == []
    deep = _folder(_folder(home / "p", 65534, alice, 0o775) / "q", 65534, alice, 0o775)
    assert untrusted_out_dir(deep / "runs", euid=0, env={"SUDO_UID": "65534"}) is None and len(calls) == 1

    def down():
        raise OSError("nss: cannot reach the directory server")

    monkeypatch.setattr(pwd, "getpwall", down)
    why = untrusted_out_dir(deep / "runs", euid=0, env={"SUDO_UID": "65534"})
    assert why and "writable by group" in why and "could not be read" in why, why
    assert untrusted_out_dir(plain / "a", euid=0, env={"SUDO_UID": "65534"}) is None  # no group write: not needed


@AS_ROOT
def test_a_sudo_user_with_no_passwd_entry_is_judged_by_sudo_gid(tmp_path):
    import grp
    import pwd

    for ids in ((pwd.getpwuid, 65533), (grp.getgrgid, 65533)):
        try:
            ids[0](ids[1])
            pytest.skip("uid or gid 65533 exists here: the test needs an id with no passwd entry (LDAP down)")
        except KeyError:
            pass
    folder = _folder(tmp_path / "theirs", 65533, 65533, 0o775)
    assert untrusted_out_dir_(folder / "x", {"SUDO_UID": "65533", "SUDO_GID": "65533"}) is None
    assert "writable by group" in untrusted_out_dir_(folder / "x", {"SUDO_UID": "65533", "SUDO_GID": "65532"})


@AS_ROOT
def test_a_sudo_user_with_no_passwd_entry_is_not_trusted_with_a_shared_group(tmp_path):
    """`users` (gid 100 on Debian) lists no one whose primary group it is: an empty member list does not make it the
    sudo user's own. Before, a 0775 folder of that group passed for a sudo user without a passwd entry, though every
    member of `users` could plant a symlink in it."""
    import grp
    import pwd

    try:
        pwd.getpwuid(65533)
        pytest.skip("uid 65533 exists here: the test needs an id with no passwd entry (LDAP down)")
    except KeyError:
        pass
    shared = next((g for g in grp.getgrall() if g.gr_gid != 0 and not g.gr_mem
                   and not any(p.pw_gid == g.gr_gid for p in pwd.getpwall())), None)
    if shared is None:
        pytest.skip("no group here with an empty member list that is no passwd entry's primary group")
    folder = _folder(tmp_path / "theirs", 65533, shared.gr_gid, 0o775)
    env = {"SUDO_UID": "65533", "SUDO_GID": str(shared.gr_gid), "SUDO_USER": "someone"}
    why = untrusted_out_dir_(folder / "x", env)
    assert why and "writable by group" in why, why
    # named as the sudo user (sudo's SUDO_USER), it is theirs
    env["SUDO_USER"] = shared.gr_name
    assert untrusted_out_dir_(folder / "x", env) is None


def untrusted_out_dir_(path, env):
    from powerprof.trust import untrusted_out_dir

    return untrusted_out_dir(path, euid=0, env=env)


@AS_ROOT
def test_dotdot_is_walked_as_the_kernel_walks_it_not_removed_first(tmp_path, monkeypatch):
    # Before: `alice/scratch/../runs/x`, `scratch` alice's symlink into a folder anyone can write, was checked as
    # `alice/runs/x` (abspath removes `..` as text), but the kernel goes through the link: root wrote in that folder.
    shared = _folder(tmp_path / "shared", 65533, 65533, 0o777)
    _folder(shared / "scratch", 65534, 65534, 0o755)
    alice = _folder(tmp_path / "alice", 65534, 65534, 0o750)
    os.symlink(shared / "scratch", alice / "scratch")
    os.lchown(alice / "scratch", 65534, 65534)
    why = untrusted_out_dir_(alice / "scratch" / ".." / "runs" / "x", {"SUDO_UID": "65534"})
    assert why and "shared is owned by uid 65533" in why, why
    _folder(alice / "runs", 65534, 65534, 0o755)
    assert untrusted_out_dir_(alice / "runs" / ".." / "x", {"SUDO_UID": "65534"}) is None  # `..` of a real folder
    monkeypatch.setenv("SUDO_UID", "65534")
    monkeypatch.chdir(alice)
    r = CliRunner().invoke(main, ["monitor", "--simulate", "seed-16g", "--duration", "0.1", "--plain",
                                  "--output", "scratch/../n.parquet"])
    assert r.exit_code == 2 and "refusing to write there as root" in r.output, r.output
    assert not os.path.lexists(shared / "n.parquet.parts") and not os.path.lexists(shared / "n.parquet")


@AS_ROOT
def test_an_out_dir_that_is_a_symlink_is_judged_by_its_owner_as_one_on_its_way(tmp_path):
    # Before: `--out link`, `link` the sudo user's own symlink to their own folder, was refused ("is a symlink") while
    # `--out link/new` passed; another user's symlink is refused either way.
    alice = _folder(tmp_path / "alice", 65534, 65534, 0o755)
    target = _folder(alice / "real", 65534, 65534, 0o755)
    for owner, ok in ((65534, True), (0, True), (65533, False)):
        link = alice / f"link{owner}"
        os.symlink(target, link)
        os.lchown(link, owner, owner)
        for path in (link, link / "new"):
            why = untrusted_out_dir_(path, {"SUDO_UID": "65534"})
            assert (why is None) == ok, (path, why)
            assert ok or "owned by uid 65533" in why, why


@AS_ROOT
def test_monitor_recover_as_root_refuses_a_file_in_a_sticky_folder_as_output_does(tmp_path, monkeypatch):
    # Before: --recover checked FILE.parts/ and FILE's folder only as a folder on its way (root's sticky /tmp allowed),
    # so root wrote FILE in /tmp, where `--output FILE` is refused: another user may plant a symlink by that name.
    monkeypatch.delenv("SUDO_UID", raising=False)
    sticky = _folder(tmp_path / "tmp", 0, 0, 0o1777)
    parts = _killed_monitor_parts(sticky)
    r = CliRunner().invoke(main, ["monitor", "--recover", str(sticky / "m.parquet")])
    assert r.exit_code == 2 and "refusing to write there as root" in r.output, r.output
    assert parts.is_dir() and not os.path.lexists(sticky / "m.parquet")
    r = CliRunner().invoke(main, ["monitor", "--simulate", "seed-16g", "--duration", "0.1", "--plain",
                                  "--output", str(sticky / "n.parquet")])
    assert r.exit_code == 2 and "refusing to write there as root" in r.output, r.output


def _planted_link(tmp_path, name):
    """A root folder `victim` and, in uid 65534's folder, their symlink `name` to it: where they would have root write."""
    victim = tmp_path / "victim"
    victim.mkdir()
    theirs = _theirs(tmp_path)
    os.symlink(victim, theirs / name)
    os.lchown(theirs / name, 65534, 65534)
    return theirs / name, victim


@AS_ROOT
@pytest.mark.parametrize("what", ["run", "fleet", "export-csv", "export-xlsx"])
def test_analyze_and_export_as_root_never_write_through_another_users_symlink(tmp_path, monkeypatch, what):
    # Before: `sudo powerprof analyze RUN --out DIR` and `export --out` wrote report.md, analysis.json, fleet.parquet,
    # windows.csv ... through a symlink uid 65534 planted at DIR, into the root folder it named; sweep, measure and
    # monitor refused such a folder.
    sys.path.insert(0, os.path.dirname(__file__))
    from synthetic_runs import make_run, seed_truth
    from test_fleet import _node

    monkeypatch.delenv("SUDO_UID", raising=False)
    src = tmp_path / "src"
    if what == "fleet":
        _node(src, 0)
    else:
        make_run(src, seed_truth(), levels=(180, 300), n_requests=4)
    link, victim = _planted_link(tmp_path, "out")
    args = {"run": ["analyze", str(src), "--bootstrap", "100", "--out", str(link)],
            "fleet": ["analyze", str(src), "--out", str(link)],
            "export-csv": ["export", str(src), "--format", "csv", "--out", str(link)],
            "export-xlsx": ["export", str(src), "--format", "xlsx", "--out", str(link / "book.xlsx")]}[what]
    r = CliRunner().invoke(main, args)
    assert r.exit_code in (1, 2) and "refusing to write there as root" in r.output, r.output
    assert "owned by uid 65534" in r.output and "Traceback" not in r.output, r.output
    assert list(victim.iterdir()) == [] and os.path.islink(link)  # nothing written through it, the link as it was


@AS_ROOT
def test_analyze_as_root_writes_its_default_folder_in_the_sudo_users_run_only(tmp_path, monkeypatch):
    # RUN/analysis, the default, is made in the run's folder: another user's run analysed by root (no sudo) is refused
    # with the fix (--out), as `sudo powerprof analyze` by the run's owner is not.
    sys.path.insert(0, os.path.dirname(__file__))
    from synthetic_runs import make_run, seed_truth

    theirs = _theirs(tmp_path)
    run = make_run(theirs / "run", seed_truth(), levels=(180, 300), n_requests=4)
    for p in (run, *run.iterdir()):
        os.chown(p, 65534, 65534)
    monkeypatch.delenv("SUDO_UID", raising=False)
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100", "--format", "md"])
    assert r.exit_code == 1 and "refusing to write there as root" in r.output and "--out" in r.output, r.output
    assert not (run / "analysis").exists()
    monkeypatch.setenv("SUDO_UID", "65534")
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100", "--format", "md"])
    assert r.exit_code == 0 and (run / "analysis" / "report.md").exists(), r.output


@AS_ROOT
@pytest.mark.parametrize("force", [False, True])
def test_trace_as_root_refuses_a_folder_another_user_controls_or_links(tmp_path, monkeypatch, force):
    # Before: `trace OUT` checked OUT's own name only, so root wrote through a folder symlink another user had planted
    # (a new file made, or with --force a file of root's replaced, in whatever folder the link named).
    monkeypatch.delenv("SUDO_UID", raising=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "important.conf").write_text("root's")
    theirs = _theirs(tmp_path)
    link = tmp_path / "traces"
    os.symlink(mine, link)
    os.lchown(link, 65534, 65534)
    for folder in (link, theirs):
        name = "important.conf" if force else "new.jsonl"
        r = CliRunner().invoke(main, ["trace", str(folder / name), "--requests", "3", *(["--force"] if force else [])])
        assert r.exit_code == 2 and "refusing to write there as root" in r.output, r.output
        assert "Traceback" not in r.output and "uid 65534" in r.output, r.output
    assert sorted(p.name for p in mine.iterdir()) == ["important.conf"] and list(theirs.iterdir()) == []
    assert (mine / "important.conf").read_text() == "root's"
    monkeypatch.setenv("SUDO_UID", "65534")  # the user who ran sudo: their own folder
    r = CliRunner().invoke(main, ["trace", str(theirs / "t.jsonl"), "--requests", "3"])
    assert r.exit_code == 0 and (theirs / "t.jsonl").exists(), r.output
