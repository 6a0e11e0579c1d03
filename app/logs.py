"""Structured logging: readable text by default, one JSON object per line when configured.

Every line carries the context it was written in: the HTTP request id, and the job, worker and
attempt being worked on. The context lives in contextvars, so it follows asyncio tasks (a task
copies its creator's context) without being passed around; fields given with `extra=` win.

Secrets never reach the output: fields named like a key, secret, password, token, signature or
authorization are replaced, passwords in URLs (and signatures of links) are masked, and bytes are
shown only by their length (so an uploaded image can never be dumped into a log).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, Final, TextIO

REQUEST_ID: Final = contextvars.ContextVar[str | None]("request_id", default=None)
JOB_ID: Final = contextvars.ContextVar[str | None]("job_id", default=None)
WORKER: Final = contextvars.ContextVar[str | None]("worker", default=None)
ATTEMPT: Final = contextvars.ContextVar[int | None]("attempt", default=None)
_CONTEXT: Final[dict[str, contextvars.ContextVar[Any]]] = {
    "request_id": REQUEST_ID,
    "job_id": JOB_ID,
    "worker": WORKER,
    "attempt": ATTEMPT,
}

FORMATS: Final = ("text", "json")
_SECRET_NAME = re.compile(r"key|secret|password|passwd|token|authorization|sig$|signature", re.IGNORECASE)
# The user name may be empty. The password runs to the authority's `@`: a URL as SQLAlchemy renders
# it keeps spaces and `+` unescaped (a password with a space was printed whole), not `@` nor `/`.
_URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@/]+@")
# A URL's query can carry a secret too: libpq and asyncpg take `?password=`, signed links `&sig=`.
_QUERY_SECRET = re.compile(r"([?&](?:ssl)?(?:password|sig)=)[^&#\s]+", re.IGNORECASE)
_API_KEY = re.compile(r"\bgpj_[A-Za-z0-9_-]{8,}")  # app.auth's key format
# Attributes every LogRecord has; anything else on a record came from `extra=`.
# (uvicorn adds `color_message`, the message with terminal colors: left out.)
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",
}
REDACTED: Final = "[redacted]"


def bind(**values: Any) -> None:
    """Set context fields (request_id, job_id, worker, attempt) for the current task and its children."""
    for name, value in values.items():
        _CONTEXT[name].set(value)


def outside_job() -> contextvars.Context:
    """A copy of the current context without its request and job (the worker kept), for a task that
    outlives the job or request that makes it: a warm runner's, which later jobs use too."""
    context = contextvars.copy_context()
    context.run(bind, request_id=None, job_id=None, attempt=None)
    return context


@contextlib.contextmanager
def bound(**values: Any) -> Iterator[None]:
    """Set context fields for the duration of a block."""
    tokens = [(_CONTEXT[name], _CONTEXT[name].set(value)) for name, value in values.items()]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def scrub(name: str, value: Any) -> Any:
    """The value safe to log under this field name."""
    if _SECRET_NAME.search(name) and value not in (None, ""):
        return REDACTED
    if isinstance(value, bytes | bytearray | memoryview):
        return f"<{len(value)} bytes>"
    if isinstance(value, str):
        return mask(value)
    return value


def mask(text: str) -> str:
    """`text` with URL passwords (in the user part or the query), link signatures and API keys masked."""
    text = _QUERY_SECRET.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))
    return _API_KEY.sub("gpj_***", text)


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields of a record: the context, then its `extra=` fields, scrubbed."""
    found: dict[str, Any] = {}
    for name, var in _CONTEXT.items():
        value = var.get()
        if value is not None:
            found[name] = value
    for name, value in vars(record).items():
        if name not in _STANDARD and not name.startswith("_"):
            found[name] = value
    return {name: scrub(name, value) for name, value in found.items()}


def utc_time(record: logging.LogRecord) -> str:
    """When the record was made: ISO 8601 in UTC, to the millisecond."""
    return datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, context and extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as a JSON line."""
        line: dict[str, Any] = {
            "time": utc_time(record),
            "level": record.levelname,
            "logger": record.name,
            "message": scrub("message", record.getMessage()),
            **fields(record),
        }
        if record.exc_info:
            line["exception"] = scrub("exception", self.formatException(record.exc_info))
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """`time level logger: message  key=value ...`, for people reading a terminal (the time in UTC).

    A record is one line, then its traceback if it has one: line breaks and other control
    characters in the message and the fields (a request's decoded path, a model's error) are
    written escaped, so no one can add a line of their own or drive the reader's terminal.
    """

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """The record's time as JSON lines give it (utc_time): the default, the host's local time
        without its zone, put lines of hosts in different zones hours apart for the same moment."""
        return utc_time(record)

    def format(self, record: logging.LogRecord) -> str:
        """The record as text, with its fields appended as key=value, then its traceback."""
        head = logging.makeLogRecord(vars(record))
        head.msg, head.args = _one_line(mask(record.getMessage())), None
        head.exc_info = head.exc_text = head.stack_info = None
        text = super().format(head)
        extra = " ".join(f"{k}={_short(v)}" for k, v in fields(record).items())
        text = f"{text}  {extra}" if extra else text
        if record.exc_info:
            text += "\n" + mask(self.formatException(record.exc_info))
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        return text


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _one_line(text: str) -> str:
    """`text` with control characters escaped as Python writes them (\\n, \\x1b)."""
    return _CONTROL.sub(lambda m: repr(m[0])[1:-1], text)


def _short(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (" " in text or not text or _CONTROL.search(text)) else text


def setup(level: str = "INFO", fmt: str = "text", *, stream: TextIO | None = None) -> None:
    """Configure the root logger once for this process (replaces earlier handlers)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # Alembic names each plugin it sets up, at INFO, seven lines at every `gpujobs migrate`.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    # uvicorn's loggers write through the root handler (the CLI passes log_config=None).
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
