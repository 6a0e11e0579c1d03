"""POSIX access ACLs (Linux): whether a user may pass through a folder, and letting one user pass.

The embedded PostgreSQL, started by root, runs as its own user, which must pass through every
folder above its data and its binaries. Letting that one user pass through an ACL entry leaves
every other user's access as it was, where widening the folder's mode opened it to all.

The ACL is read and written as the `system.posix_acl_access` extended attribute, in the kernel's
format (linux/posix_acl_xattr.h): a version, then (tag, permissions, id) entries, little-endian,
ordered by tag and then id. No `setfacl` is needed (it is often not installed).
"""

from __future__ import annotations

import errno
import functools
import operator
import os
import stat
import struct
from pathlib import Path

XATTR = "system.posix_acl_access"
VERSION = 2
# Entry tags (linux/posix_acl.h); NO_ID is the id of the entries that name no one.
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
NO_ID = 0xFFFFFFFF
SEARCH = 0o1  # x, on a folder: pass through it

_HEADER = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")

# {(tag, id): permissions (rwx as 0o7)}
Entries = dict[tuple[int, int], int]


def read(folder: Path) -> Entries:
    """The folder's access ACL; the three entries its mode stands for when it has none (or the
    file system keeps no ACLs)."""
    try:
        raw = os.getxattr(folder, XATTR)
    except OSError as exc:
        if exc.errno not in (errno.ENODATA, errno.EOPNOTSUPP):
            raise
        mode = os.stat(folder).st_mode
        return {(USER_OBJ, NO_ID): mode >> 6 & 7, (GROUP_OBJ, NO_ID): mode >> 3 & 7, (OTHER, NO_ID): mode & 7}
    return {(tag, ident): perm for tag, perm, ident in _ENTRY.iter_unpack(raw[_HEADER.size :])}


def can_search(folder: Path, uid: int, gids: set[int]) -> bool:
    """Whether a process of user `uid` in groups `gids` may pass through `folder`, as the kernel
    decides (fs/namei.c, acl_permission_check): its owner by the owner's bits; else, where the
    folder has an ACL and its mask (the mode's group bits) is not empty, the first class of entries
    that names it (acl(5)); else the mode's group bits for its group, the other bits for the rest."""
    info = os.stat(folder)
    if info.st_uid == uid:
        return bool(info.st_mode & stat.S_IXUSR)
    entries = read(folder)
    mask = entries.get((MASK, NO_ID))
    if mask:  # an ACL the kernel applies
        if (USER, uid) in entries:
            return bool(entries[(USER, uid)] & mask & SEARCH)
        groups = [perm for (tag, ident), perm in entries.items() if tag == GROUP and ident in gids]
        if info.st_gid in gids:
            groups.append(entries[(GROUP_OBJ, NO_ID)])
        if groups:  # a group entry that matches, and none lets it pass: denied, whatever others have
            return any(perm & mask & SEARCH for perm in groups)
        return bool(info.st_mode & stat.S_IXOTH)
    if info.st_gid in gids:
        return bool(info.st_mode & stat.S_IXGRP)
    return bool(info.st_mode & stat.S_IXOTH)


def grant_search(folder: Path, uid: int) -> None:
    """Give user `uid` search (x) on `folder` through a named entry, keeping every other entry.

    A named entry needs a mask, which limits it and the group entries: a new mask is what those
    entries already grant (plus x); an existing one gains x, and where it held x back, the other
    entries it limits lose the x it held back, so no one else gains anything. The mode's group bits
    then show the mask (0700 reads 0710). Raises OSError where the file system keeps no ACLs
    (EOPNOTSUPP) or refuses them."""
    entries = read(folder)
    entries[(USER, uid)] = entries.get((USER, uid), 0) | SEARCH
    if (MASK, NO_ID) in entries:
        if not entries[(MASK, NO_ID)] & SEARCH:
            for key in entries:
                if key[0] in (USER, GROUP_OBJ, GROUP) and key != (USER, uid):
                    entries[key] &= ~SEARCH
        entries[(MASK, NO_ID)] |= SEARCH
    else:
        limited = [perm for (tag, _), perm in entries.items() if tag in (USER, GROUP_OBJ, GROUP)]
        entries[(MASK, NO_ID)] = functools.reduce(operator.or_, limited, 0)
    raw = _HEADER.pack(VERSION) + b"".join(
        _ENTRY.pack(tag, perm, ident) for (tag, ident), perm in sorted(entries.items())
    )
    os.setxattr(folder, XATTR, raw)
