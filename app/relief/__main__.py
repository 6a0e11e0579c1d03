"""`python -m app.relief`: run the relief model once."""

from __future__ import annotations

from app.relief import cli

if __name__ == "__main__":
    raise SystemExit(cli.main())
