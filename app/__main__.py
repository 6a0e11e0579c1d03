"""`python -m app` is the `gpujobs` command."""

from app.cli import main

main()
