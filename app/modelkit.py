"""The warm-runner line protocol, and `serve()`: a persistent model runner in a few lines of Python.

One JSON object per UTF-8 line, at most MAX_LINE_BYTES (docs/persistent.md shows every message):

    runner -> worker  {"ready": true, "model": "relief", "pid": 123}        once, after loading
    worker -> runner  {"job": "<id>:<attempt>", "input": "/abs/in.png", "output_dir": "/abs/out",
                       "params": {...}}                                     one job at a time
    runner -> worker  {"job": J, "progress": 0.3, "message": "meshing"}     zero or more, then one of
                      {"job": J, "done": true, "outputs": ["mesh.glb"]}
                      {"job": J, "error": "...", "bad_input": false, "oom": false}
                      {"job": J or null, "error": "...", "protocol": true}  the job line was malformed

A runner exits 0 when its stdin closes (the worker closed it, or died). `serve()` keeps the real
stdout for protocol lines only: file descriptor 1 (Python prints and C extensions alike) is pointed
at stderr and fd 0 at /dev/null, so nothing the model does can break the protocol. This module
needs only the standard library and Python 3.8: a model living in another environment may copy it
(so nothing 3.10+ runs here: no `X | Y` outside annotations, no match, no dataclass slots).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import select
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Union

# A runner imports this module before its model, so it keeps to light imports: no asyncio (the
# worker's side frames replies from bytes), `traceback` only on an error, and the messages are NamedTuples
# (dataclasses, with the `inspect` it imports, cost a runner's start 15-20 ms of CPU on 2 cores).
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping
    from typing import Any, BinaryIO, Final, TypeAlias, TypeVar

    M = TypeVar("M")

MAX_LINE_BYTES: Final = 1024 * 1024  # both directions; a longer line is a protocol error
EXIT_LOAD_FAILED: Final = 3  # load() raised
EXIT_ORPHANED: Final = 4  # stdin closed while a job ran: the worker is gone, nobody wants the result
MAX_ERROR_CHARS: Final = 8192
MAX_MESSAGE_CHARS: Final = 200  # what the service keeps of a progress message (PROGRESS_MESSAGE_CHARS)
OOM_MARKERS: Final = (
    "OutOfMemoryError", "CUDA out of memory", "cudaErrorMemoryAllocation", "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED", "out of memory on device",
)  # fmt: skip


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class ProtocolError(ValueError):
    """A line that is not a valid protocol message."""


class BadInput(Exception):
    """The job's input or params cannot be processed; retrying will not help."""


class Request(NamedTuple):
    """Worker -> runner: one job."""

    job: str
    input: Path
    output_dir: Path
    params: Mapping[str, Any]

    def encode(self) -> bytes:
        """The request as one protocol line."""
        message = {"job": self.job, "input": str(self.input), "output_dir": str(self.output_dir)}
        return _line({**message, "params": dict(self.params)})


class Ready(NamedTuple):
    """Runner -> worker: the model is loaded."""

    model: str
    pid: int | None


class Progress(NamedTuple):
    """Runner -> worker: how far the job is (fraction in [0, 1])."""

    job: str
    fraction: float
    message: str = ""


class Done(NamedTuple):
    """Runner -> worker: the job succeeded; its files are in the output folder."""

    job: str
    outputs: tuple[str, ...] = ()


class Failed(NamedTuple):
    """Runner -> worker: the job failed (`protocol`: its request line was malformed)."""

    job: str | None
    error: str
    bad_input: bool = False
    oom: bool = False
    protocol: bool = False


# Union, not `|`: this line runs at import, and a copied kit must import on Python 3.8 and 3.9.
Reply: TypeAlias = Union[Ready, Progress, Done, Failed]  # noqa: UP007


def encode(reply: Reply) -> bytes:
    """A reply as one protocol line (texts are shortened to their limits)."""
    if isinstance(reply, Ready):
        return _line({"ready": True, "model": reply.model, "pid": reply.pid})
    if isinstance(reply, Progress):
        text = reply.message[:MAX_MESSAGE_CHARS]
        return _line({"job": reply.job, "progress": reply.fraction, "message": text})
    if isinstance(reply, Done):
        return _line({"job": reply.job, "done": True, "outputs": list(reply.outputs)})
    extra = {"protocol": True} if reply.protocol else {"bad_input": reply.bad_input, "oom": reply.oom}
    return _line({"job": reply.job, "error": reply.error[:MAX_ERROR_CHARS], **extra})


def _line(message: Mapping[str, Any]) -> bytes:
    """One JSON object as one protocol line."""
    return (json.dumps(message, allow_nan=False, separators=(",", ":")) + "\n").encode()


def _object(line: bytes) -> dict[str, Any]:
    """The JSON object on one line; ProtocolError when it is not one. A lone surrogate escape
    ("\\udcff", what json.dumps writes for a file name that is not UTF-8) reads as U+FFFD: such a
    text could be neither logged nor stored."""
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"line over {MAX_LINE_BYTES} bytes")
    try:
        decoder = _UNICODE_DECODER if _SURROGATE_ESCAPE.search(line) else _DECODER  # rare: parse it slowly
        message = decoder.decode(line.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # ValueError covers UnicodeDecodeError
        raise ProtocolError(f"not a JSON line: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"not a JSON object but {type(message).__name__}")
    return message


def _no_constant(name: str) -> Any:
    """json.loads takes NaN and Infinity, which JSON has not (json.dumps writes them only when
    allowed); a line with one is no JSON line."""
    raise ValueError(f"{name} is not JSON")


# Made once: json.loads with any option set makes a decoder at every call.
_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def _unicode(value: Any) -> Any:
    """A JSON value with every string's lone surrogates replaced by U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value) if _SURROGATE.search(value) else value
    return [_unicode(item) for item in value] if isinstance(value, list) else value


def _unicode_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' hook: an object with `_unicode` keys and values (nested objects come done)."""
    return {_unicode(key): _unicode(value) for key, value in pairs}


_UNICODE_DECODER = json.JSONDecoder(parse_constant=_no_constant, object_pairs_hook=_unicode_object)


def _get(message: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """message[key] when it has the right JSON type (bool is no number); ProtocolError otherwise."""
    if key not in message and default is not ...:
        return default
    value = message.get(key)
    number = kind in (int, float, (int, float))
    if key not in message or not isinstance(value, kind) or (number and isinstance(value, bool)):
        raise ProtocolError(f"{key!r} is missing or has the wrong type")
    return value


def parse_request(line: bytes) -> Request:
    """Read a worker's job line; ProtocolError names what is wrong (unknown keys are ignored)."""
    message = _object(line)
    job = _get(message, "job", str)
    paths = [Path(_get(message, key, str)) for key in ("input", "output_dir")]
    params = _get(message, "params", dict)
    if not job or len(job) > 200:
        raise ProtocolError("'job' must be 1 to 200 characters")
    if not all(path.is_absolute() for path in paths):
        raise ProtocolError("'input' and 'output_dir' must be absolute paths")
    return Request(job, paths[0], paths[1], params)


def parse_reply(line: bytes) -> Reply:
    """Read a runner's line; ProtocolError names what is wrong (unknown keys are ignored)."""
    message = _object(line)
    if "ready" in message:
        if message["ready"] is not True:
            raise ProtocolError("'ready' must be true")
        return Ready(_get(message, "model", str, ""), _get(message, "pid", int, None))
    if "error" in message:
        job = message.get("job")
        if job is not None and not isinstance(job, str):
            raise ProtocolError("'job' must be a string or null")
        flags = [bool(_get(message, key, bool, False)) for key in ("bad_input", "oom", "protocol")]
        return Failed(job, _get(message, "error", str), *flags)
    job = _get(message, "job", str)
    if "progress" in message:
        # Clamped before float(): an integer too large for a float is still past 1.
        fraction = float(min(max(_get(message, "progress", (int, float)), 0), 1))
        return Progress(job, fraction, _get(message, "message", str, ""))
    if "done" in message:
        outputs = _get(message, "outputs", list, [])
        if message["done"] is not True or not all(isinstance(name, str) for name in outputs):
            raise ProtocolError("'done' must be true and 'outputs' a list of file names")
        return Done(job, tuple(outputs))
    raise ProtocolError("not a ready, progress, done or error message")


class ReplyLines:
    """The worker's framing of a runner's stdout: bytes in as they come, replies out line by line,
    each a reply or a protocol violation as text. What is left is an unfinished line (`unfinished`),
    which the worker checks: one begun while no reply is awaited is out of turn."""

    __slots__ = ("unfinished",)

    def __init__(self) -> None:
        self.unfinished = b""  # the start of a line whose newline has not come yet

    def feed(self, data: bytes) -> list[Reply | str]:
        """The replies of the lines `data` completes, and a violation if the unfinished line is
        already too long."""
        *lines, self.unfinished = (self.unfinished + data).split(b"\n")
        replies = [_reply_or_violation(line) for line in lines]
        if len(self.unfinished) > MAX_LINE_BYTES:
            replies.append(f"a line over {MAX_LINE_BYTES} bytes")
        return replies

    def end(self) -> str | None:
        """At EOF: the unterminated last line as a violation, or None."""
        return f"unterminated last line {self.unfinished[:200]!r}" if self.unfinished else None


def _reply_or_violation(line: bytes) -> Reply | str:
    """parse_reply, with a protocol error as its text and the line's start."""
    try:
        return parse_reply(line)
    except ProtocolError as exc:
        return f"{exc}: {line[:200]!r}"


def is_oom(exc: BaseException) -> bool:
    """Whether an exception (or one it was raised from) looks like running out of GPU memory."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names = " ".join(kind.__name__ for kind in type(current).__mro__)
        if any(marker in f"{names} {current}" for marker in OOM_MARKERS):
            return True
        current = current.__cause__ or current.__context__
    return False


class Job(NamedTuple):
    """One job as the model author sees it: read `input`, write into `output_dir`, report progress."""

    id: str
    input: Path
    output_dir: Path
    params: Mapping[str, Any]
    send: Callable[[Reply], None]

    def __repr__(self) -> str:  # `send` left out
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields[:-1])
        return f"Job({shown})"

    def progress(self, fraction: float, message: str = "") -> None:
        """Report how far the job is (0..1, clamped; NaN is ignored) with a short message."""
        if not math.isnan(fraction):
            self.send(Progress(self.id, float(min(max(fraction, 0), 1)), str(message)))


class _Channel:
    """The protocol's private ends of stdin and stdout; a thread watches for the worker's end."""

    def __init__(self, reader: BinaryIO, writer: BinaryIO) -> None:
        self._reader, self._writer = reader, writer
        self._lock = threading.Lock()
        self._job: str | None = None  # the job running now
        self._gone = False  # the worker's end of stdin is closed
        self._loading = True  # before the ready line: a hang-up then ends the process at once
        self._hang_up = select.poll()  # polled for no event at all: it reports only the hang-up
        self._hang_up.register(reader.fileno(), 0)

    @classmethod
    def take_stdio(cls) -> _Channel:
        """Keep private copies of fds 0 and 1; point fd 1 at stderr and fd 0 at /dev/null; watch
        for the worker's end of stdin closing."""
        sys.stdout.flush()
        reader, writer = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
        os.dup2(2, 1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if isinstance(sys.stdout, io.TextIOWrapper):
            sys.stdout.reconfigure(line_buffering=True)
        channel = cls(reader, writer)
        channel.watch()  # from now on: a hang-up while the model loads ends the process too
        return channel

    def send(self, reply: Reply) -> None:
        """Write one protocol line (any thread may call this); progress of a job not running is
        dropped: a thread the model left behind must not speak after its job's final reply."""
        with self._lock:
            if isinstance(reply, Progress) and reply.job != self._job:
                return
            self._writer.write(encode(reply))
            self._writer.flush()

    def watch(self) -> None:
        """Start the thread that sleeps until the worker's end of stdin closes (see `_watch`)."""
        threading.Thread(target=self._watch, name="modelkit-watch", daemon=True).start()

    def ready(self, name: str) -> None:
        """Say the model is loaded: from now on a hang-up ends only a job running."""
        self._loading = False
        self.send(Ready(name, os.getpid()))

    def requests(self) -> Iterator[bytes]:
        """Request lines until stdin closes (an overlong line comes back cut, for its error).

        The lines are read here, on the caller's thread: a reader thread would cost two thread
        wake-ups per job.
        """
        while line := self._reader.readline(MAX_LINE_BYTES + 1):
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                while (rest := self._reader.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                    pass  # skip the rest of the overlong line
            yield line

    def begin(self, job: str) -> bool:
        """Mark `job` as running; False if the worker is gone (a line it sent before it went).

        A hang-up that came before is looked for here first, before the job is marked: the watch
        thread may not have looked yet, and the job would have run
        until it did, then died for nobody (exit 4)."""
        if self._hung_up():
            return False
        self._job = job
        return not self._gone

    def _hung_up(self) -> bool:
        """Whether the worker's end of stdin is closed now (a poll that does not wait)."""
        return bool(self._hang_up.poll(0))

    def end(self) -> None:
        """Mark the job as over (under the lock: no progress of it is written after this)."""
        with self._lock:
            self._job = None

    def _watch(self) -> None:
        """Wait for stdin's hang-up; a job running then is for nobody, so end the whole process, and
        a load still going is for nobody either (a worker killed while its runner loaded).

        Polled for no event at all, a pipe still reports its hang-up (and errors), never a request.
        Between `begin`'s two steps and these two, one side always sees the other's flag.
        """
        poller = select.poll()
        poller.register(self._reader.fileno(), 0)
        poller.poll()  # no timeout: it returns only with the hang-up (EINTR is retried by Python)
        self._gone = True
        if self._loading:
            _say("stdin closed while loading: the worker is gone; exiting")
            os._exit(0)
        if self._job is not None:
            _say("stdin closed during a job: the worker is gone; exiting")
            os._exit(EXIT_ORPHANED)


def stderr_end(job: str) -> bytes:
    """The last stderr line of a job, written just before its final reply: once the worker has read
    it, the job's stderr is all in the job's log and no settling wait is needed."""
    return f"[modelkit] job {job} ended\n".encode()


def _say(text: str) -> None:
    """A line of the kit's own on stderr (it lands in the runner's and the job's log)."""
    print(f"[modelkit] {text}", file=sys.stderr, flush=True)


def serve(
    load: Callable[[], M],
    handle: Callable[[M, Job], Iterable[str] | None],
    *,
    name: str,
    bad_input: tuple[type[BaseException], ...] = (),
) -> int:
    """Load the model once, then answer jobs until stdin closes; return the process exit code.

    `handle(model, job)` may return the output file names; by default every plain file in
    `job.output_dir` is listed. Exceptions of the `bad_input` types (and BadInput) fail the job
    without retry; any other exception fails it as a model error, marked `oom` when it looks so.
    """
    channel = _Channel.take_stdio()
    _say(f"loading {name} (pid {os.getpid()})")
    started = time.monotonic()
    try:
        model = load()
    except Exception:
        _print_exc()
        _say(f"loading {name} failed")
        return EXIT_LOAD_FAILED
    _say(f"loaded {name} in {time.monotonic() - started:.2f} s")
    channel.ready(name)
    for line in channel.requests():
        try:
            request = parse_request(line)
        except ProtocolError as exc:
            _say(f"rejected a malformed job line: {exc}")
            channel.send(Failed(_job_of(line), str(exc), protocol=True))
            continue
        job = Job(request.job, request.input, request.output_dir, request.params, channel.send)
        if not channel.begin(job.id):
            _say(f"job {job.id} came just before stdin closed: the worker is gone; not run")
            break
        reply = _run(handle, model, job, (BadInput, *bad_input))
        channel.end()
        channel.send(reply)
    _say("stdin closed; exiting")
    return 0


def _run(
    handle: Callable[[M, Job], Iterable[str] | None],
    model: M,
    job: Job,
    bad_input: tuple[type[BaseException], ...],
) -> Done | Failed:
    """Run one job and turn its end into the final reply; stderr is flushed before that is sent."""
    try:
        job.output_dir.mkdir(parents=True, exist_ok=True)
        returned = handle(model, job)
        if returned is None:  # every plain file it wrote
            outputs = sorted(p.name for p in job.output_dir.iterdir() if p.is_file() and p.name[0] != ".")
        else:
            outputs = [str(name) for name in returned]
        reply: Done | Failed = Done(job.id, tuple(outputs))
    except bad_input as exc:
        _say(f"job {job.id}: bad input: {exc}")
        reply = Failed(job.id, str(exc) or type(exc).__name__, bad_input=True)
    except (Exception, SystemExit) as exc:  # sys.exit() in a library (argparse, say) is the job's error
        _print_exc()
        reply = Failed(job.id, f"{type(exc).__name__}: {exc}", oom=is_oom(exc))
    _free_gpu_cache()
    sys.stdout.flush()
    sys.stderr.flush()
    print(stderr_end(job.id).decode(), end="", file=sys.stderr, flush=True)
    return reply


def _print_exc() -> None:
    """The exception being handled, with its traceback, on stderr."""
    import traceback

    traceback.print_exc()


def _job_of(line: bytes) -> str | None:
    """The job id of a malformed request, when it can be read at all."""
    try:
        job = json.loads(line).get("job")
    except (ValueError, RecursionError, AttributeError):
        return None
    return job if isinstance(job, str) and len(job) <= 200 else None


def _free_gpu_cache() -> None:
    """Hand PyTorch's cached blocks back after each job: an idle runner holds only what it keeps."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            torch.cuda.empty_cache()
        except Exception as exc:  # a broken CUDA context shows up on the next job
            _say(f"torch.cuda.empty_cache() failed: {exc!r}")
