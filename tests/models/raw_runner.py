"""A persistent test runner that speaks the line protocol itself, without app/modelkit.py (which
keeps a runner's words within bounds), and answers each job as its params say.

Params: error_kb (answer an error of that many KiB), empty_error (answer an error with no words),
other_id (answer done for another job), close_stdout (close stdout and stay), hardlink (out.txt is
a second name of a file in the runner's HOME, which the runner can change after the job). Else it
writes out.txt, done.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def answer(request: dict[str, object]) -> dict[str, object]:
    job, params = request["job"], request["params"]
    assert isinstance(params, dict)
    out = Path(str(request["output_dir"]))
    out.mkdir(parents=True, exist_ok=True)
    if params.get("error_kb"):
        return {"job": job, "error": "x" * (int(params["error_kb"]) * 1024)}
    if params.get("empty_error"):
        return {"job": job, "error": ""}
    if params.get("other_id"):
        return {"job": f"{job}0", "done": True}
    if params.get("close_stdout"):
        os.close(1)
        time.sleep(60)
    if params.get("hardlink"):
        kept = Path(os.environ["HOME"]) / "kept.txt"
        kept.write_text("the runner's own file\n")
        os.link(kept, out / "out.txt")
    else:
        (out / "out.txt").write_text(f"{job}\n")
    return {"job": job, "done": True, "outputs": ["out.txt"]}


def main() -> int:
    print(json.dumps({"ready": True, "model": "raw", "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        print(json.dumps(answer(json.loads(line))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
