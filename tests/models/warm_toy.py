"""A persistent test model served with app.modelkit: counts loads, sleeps, crashes or hangs on request.

argv: --loads FILE (one line per load), --load-sleep S, --fail-load, --linger S (once stdin
closes, stay S seconds more, deaf to SIGTERM: a runner slow to close). Job params (all optional):
sleep (s), steps, crash (os._exit mid-job), hang (loop forever), spawn (leave a sleeping child in the
group), junk (print to stdout from Python and from the fd), noise_kb (print that many KiB of lines
to stderr), late (a thread reports progress after the job ended), bad_input, oom, fail, fill_kb
(write a file of that many KiB), temp (make a temporary file, its path written to the loads file's
name + ".temp"), daemon (leave a sleeping process in a session of its own, its pid appended to
the loads file's name + ".daemon"), retire_ms (once the job is answered, exit 0 that many ms
later, taking no other job meanwhile: a runner that retires itself between jobs). Writes out.txt.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from app import modelkit

LOADS: Path | None = None  # --loads
RETIRING = threading.Event()  # a job asked this runner to retire once it answered


class OutOfMemoryError(RuntimeError):
    """Named like torch.cuda.OutOfMemoryError, which the kit recognises by name."""


def load(loads: Path | None, sleep_s: float, fail: bool) -> dict[str, int]:
    """Count the load, take a while, maybe fail."""
    print("warm_toy: loading (a print to stdout)")  # must not reach the protocol
    if loads is not None:
        with loads.open("a") as f:
            f.write(f"{os.getpid()}\n")
    time.sleep(sleep_s)
    if fail:
        raise RuntimeError("warm_toy: load failed on purpose")
    return {"pid": os.getpid()}


def handle(model: dict[str, int], job: modelkit.Job) -> None:
    """Do what the params ask."""
    params = job.params
    while RETIRING.is_set():  # a job sent to a runner about to exit: never taken
        time.sleep(0.05)
    if params.get("temp") and LOADS is not None:  # where the runner's temporary files go
        fd, made = tempfile.mkstemp(prefix="warm_toy-")
        os.close(fd)
        LOADS.with_name(LOADS.name + ".temp").write_text(made)
    if params.get("daemon") and LOADS is not None:  # out of the runner's process group
        daemon = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
        )
        with LOADS.with_name(LOADS.name + ".daemon").open("a") as f:
            f.write(f"{daemon.pid}\n")
    steps = int(params.get("steps", 2))
    for step in range(1, steps + 1):
        time.sleep(float(params.get("sleep", 0.0)) / steps)
        job.progress(step / steps, f"step {step}")
        attempt = int(job.id.rsplit(":", 1)[1])
        if (params.get("crash") or attempt <= int(params.get("crash_attempts", 0))) and step == 1:
            os._exit(13)
    if params.get("junk"):
        print("junk from print()", flush=True)
        os.write(1, b"junk from fd 1\n")
    for i in range(int(params.get("noise_kb", 0)) * 16):  # numbered lines of 64 bytes
        sys.stderr.write(f"noise line {i:08d} {'.' * 43}\n")
    sys.stderr.flush()
    if params.get("late"):  # like a progress thread of the model's that outlives its job
        threading.Timer(0.2, job.progress, (0.99, "late")).start()
    if params.get("spawn"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        (job.output_dir / "child.pid").write_text(str(child.pid))
    while params.get("hang"):
        time.sleep(0.05)
    if params.get("bad_input"):
        raise modelkit.BadInput("the input is not what warm_toy wants")
    if params.get("oom"):
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    if params.get("fail"):
        raise ValueError("warm_toy failed on purpose")
    if params.get("fill_kb"):  # a large output: on a full disk, the write fails (ENOSPC)
        (job.output_dir / "fill.bin").write_bytes(bytes(int(params["fill_kb"]) * 1024))
    (job.output_dir / "out.txt").write_text(f"{job.id} pid {model['pid']} input {job.input.name}\n")
    if int(params.get("retire_ms", -1)) >= 0:  # the kit answers once this returns
        RETIRING.set()
        threading.Timer(int(params["retire_ms"]) / 1000, os._exit, (0,)).start()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loads", type=Path)
    parser.add_argument("--load-sleep", type=float, default=0.0)
    parser.add_argument("--fail-load", action="store_true")
    parser.add_argument("--linger", type=float, default=0.0)
    args = parser.parse_args()
    global LOADS
    LOADS = args.loads
    code = modelkit.serve(lambda: load(args.loads, args.load_sleep, args.fail_load), handle, name="warm_toy")
    if args.linger:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(args.linger)
    return code


if __name__ == "__main__":
    sys.exit(main())
