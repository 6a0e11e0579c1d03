"""POSIX ACLs: the check mirrors the kernel's, and a grant gives one user search and no one else more."""

from __future__ import annotations

import os
import stat

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
