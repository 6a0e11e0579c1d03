"""`GPUJOBS_*` environment variables that are no setting: most often a misspelt one.

pydantic-settings drops a name it does not know (`extra="ignore"`), so `GPUJOBS_PORTT=18200` left
the server on port 8000 without a word. The commands that read the settings (app/cli.py) log one
warning for each such name, with the setting it most resembles. Only names are shown, never values
(a misspelt GPUJOBS_LINK_SECRET holds a secret).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from app import settings

PREFIX = "GPUJOBS_"
# Read on purpose, though they are not settings: the client's server and key (app/client.py), the
# markers a worker puts in its model processes' environment (app/queue/oneshot.py, warmrun.py; a
# restart finds its strays by them, app/queue/leftovers.py), and the fuzz test's example count.
NOT_SETTINGS = frozenset(
    {
        "GPUJOBS_URL",
        "GPUJOBS_API_KEY",
        "GPUJOBS_JOB",
        "GPUJOBS_WORKER",
        "GPUJOBS_RUNNER",
        "GPUJOBS_QUEUE",
        "GPUJOBS_FUZZ_EXAMPLES",
    }
)


def known() -> frozenset[str]:
    """Every GPUJOBS_* name something reads: the settings and `NOT_SETTINGS`."""
    return frozenset(PREFIX + name.upper() for name in settings.Settings.model_fields) | NOT_SETTINGS


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A line for each GPUJOBS_* name in `environ` that nothing reads (in any case, as
    pydantic-settings matches them), in name order, with the known name it most resembles; and one
    for DATABASE_URL without GPUJOBS_DATABASE_URL."""
    names = known()
    # Compared without the prefix, which every name shares: with it, any two names look alike.
    by_rest = {name.removeprefix(PREFIX): name for name in names}
    lines = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(PREFIX) or upper in names:
            continue
        close = difflib.get_close_matches(upper.removeprefix(PREFIX), by_rest, n=1)
        hint = (
            f"did you mean {by_rest[close[0]]}?"
            if close
            else "no setting has a name like it; `python -m app.settings` lists them"
        )
        lines.append(f"{name} is not a setting ({hint})")
    # The tests' variable for their server (README, "The two commands"). Set for `serve`, it was
    # ignored without a word, and the service ran on the embedded database instead.
    if "DATABASE_URL" in environ and not any(name.upper() == "GPUJOBS_DATABASE_URL" for name in environ):
        lines.append(
            "DATABASE_URL is read by the tests only; the service reads GPUJOBS_DATABASE_URL (unset: the"
            " embedded PostgreSQL in the storage folder)"
        )
    return lines
