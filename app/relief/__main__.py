"""`python -m app.relief`: run the relief model once, or with `--serve` as a warm runner."""

from __future__ import annotations

import sys

from app.relief import cli, serve

if __name__ == "__main__":
    raise SystemExit(serve.main() if "--serve" in sys.argv[1:] else cli.main())
