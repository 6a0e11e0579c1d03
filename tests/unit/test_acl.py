"""POSIX ACLs: the check mirrors the kernel's, and a grant gives one user search and no one else more."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import acl

STRANGER = 54_321  # a uid and gid that own nothing here


def test_a_grant_gives_one_user_search_and_keeps_everyone_elses_access(tmp_path):
    """The embedded PostgreSQL's user was let through the folders above its data by `chmod
    g+rx,o+rx`, which opened them to every user; the grant adds one named entry (x) and a mask
    that lets the folder's group keep exactly what it had."""
    folder = tmp_path / "home"
    folder.mkdir()
    folder.chmod(0o750)
    try:
        acl.grant_search(folder, STRANGER)
    except OSError as exc:
        pytest.skip(f"no ACLs here: {exc}")
    entries = acl.read(folder)
    assert entries[(acl.USER, STRANGER)] == acl.SEARCH
    assert entries[(acl.GROUP_OBJ, acl.NO_ID)] == 0o5 and entries[(acl.MASK, acl.NO_ID)] == 0o5
    assert entries[(acl.OTHER, acl.NO_ID)] == 0 and stat.S_IMODE(folder.stat().st_mode) == 0o750
    assert acl.can_search(folder, STRANGER, {STRANGER})
    assert not acl.can_search(folder, STRANGER + 1, {STRANGER + 1})
    acl.grant_search(folder, STRANGER)  # a second grant changes nothing
    assert acl.read(folder) == entries


def test_a_matching_group_that_denies_wins_over_others_search(tmp_path):
    """As the kernel decides: a process in the folder's group gets the group's bits, not others'
    (the wheel runs PostgreSQL in root's group: a root folder of mode 0701 stops it)."""
    folder = tmp_path / "f"
    folder.mkdir()
    folder.chmod(0o701)
    group = os.stat(folder).st_gid
    assert not acl.can_search(folder, STRANGER, {group})
    assert acl.can_search(folder, STRANGER, {STRANGER})
    assert acl.can_search(folder, os.stat(folder).st_uid, set())  # its owner: the owner's bits


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A folder every user can pass through to (pytest's own are closed to all but root)."""
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    folder.chmod(0o711)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def write(folder, entries) -> None:
    """Set `folder`'s access ACL to `entries` ({(tag, id): perm}), as setfacl would."""
    raw = acl._HEADER.pack(acl.VERSION) + b"".join(
        acl._ENTRY.pack(tag, perm, ident) for (tag, ident), perm in sorted(entries.items())
    )
    os.setxattr(folder, acl.XATTR, raw)


def kernel_lets_through(folder, uid: int, gid: int) -> bool:
    """Whether the kernel lets a process of `uid` in group `gid` alone look inside `folder`."""
    (folder / "inside").mkdir(exist_ok=True)
    probe = subprocess.run(
        ["stat", str(folder / "inside")], user=uid, group=gid, extra_groups=[], capture_output=True
    )
    return probe.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a probe as other users")
def test_a_grant_under_a_mask_without_search_lets_no_one_else_through(reachable):
    """A folder whose mask held back a named user's x (`setfacl -m u:alice:rwx; chmod 700`): the
    grant added x to the mask, and alice and the folder's group, denied until then, could pass.
    The others' entries now lose the x the mask held back, so only the granted user gains."""
    folder = reachable / "home"
    folder.mkdir()
    group = os.stat(folder).st_gid
    try:
        write(folder, {
            (acl.USER_OBJ, acl.NO_ID): 0o7, (acl.USER, STRANGER): 0o7, (acl.GROUP_OBJ, acl.NO_ID): 0o5,
            (acl.MASK, acl.NO_ID): 0o4, (acl.OTHER, acl.NO_ID): 0,
        })  # fmt: skip
    except OSError as exc:
        pytest.skip(f"no ACLs here: {exc}")
    granted = STRANGER + 1
    before = [kernel_lets_through(folder, STRANGER, STRANGER), kernel_lets_through(folder, granted, group)]
    assert before == [False, False]
    acl.grant_search(folder, granted)
    assert kernel_lets_through(folder, granted, granted)
    assert not kernel_lets_through(folder, STRANGER, STRANGER)
    assert not kernel_lets_through(folder, STRANGER + 2, group)
    assert not acl.can_search(folder, STRANGER, {STRANGER})


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a probe as other users")
def test_an_acl_whose_mask_is_empty_is_read_as_the_kernel_reads_it(reachable):
    """With no bit in the mask (the mode's group bits), the kernel checks the mode alone; the check
    applied the ACL's named entry and denied a user the mode lets through, then granted it for
    nothing."""
    folder = reachable / "f"
    folder.mkdir()
    try:
        write(folder, {
            (acl.USER_OBJ, acl.NO_ID): 0o7, (acl.USER, STRANGER): 0o1, (acl.GROUP_OBJ, acl.NO_ID): 0,
            (acl.MASK, acl.NO_ID): 0, (acl.OTHER, acl.NO_ID): 0o1,
        })  # fmt: skip
    except OSError as exc:
        pytest.skip(f"no ACLs here: {exc}")
    assert kernel_lets_through(folder, STRANGER, STRANGER)
    assert acl.can_search(folder, STRANGER, {STRANGER})
