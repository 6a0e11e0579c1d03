"""A tiny test model: sleeps, reports progress, writes an output, fails, crashes or floods its log on request.

Options come from the registry's argv template (see tests/conftest.py).
"""

import argparse
import json
import os
import signal
import sys
import time


def noise(kib: int) -> None:
    """Numbered lines of 64 bytes on stderr, `kib` KiB of them (a model that will not stop talking)."""
    for i in range(kib * 16):
        sys.stderr.write(f"noise line {i:08d} {'.' * 43}\n")
    sys.stderr.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--fail-attempts", type=int, default=0, help="fail while attempt <= this")
    parser.add_argument("--signal", default="none", help="kill itself with this signal")
    parser.add_argument("--output", default="true")
    parser.add_argument("--trace", default="", help="append a JSON line per run to this file (none: off)")
    parser.add_argument("--oom-attempts", type=int, default=0, help="out of GPU memory while attempt <= this")
    parser.add_argument("--noise-kb", type=int, default=0, help="print this many KiB of lines to stderr")
    args = parser.parse_args()

    job = os.environ.get("GPUJOBS_JOB", "?:0")
    attempt = int(job.rsplit(":", 1)[1])
    started = time.time()
    for step in range(1, args.steps + 1):
        time.sleep(args.sleep / max(args.steps, 1))
        print(f"PROGRESS {step / args.steps:.3f} step {step}", flush=True)
    noise(args.noise_kb)
    print("toy model stderr line", file=sys.stderr, flush=True)
    if args.trace and args.trace != "none":
        with open(args.trace, "a") as f:
            record = {
                "job": job,
                "pid": os.getpid(),
                "start": started,
                "end": time.time(),
                "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
            }
            f.write(json.dumps(record) + "\n")
    if args.signal != "none":
        os.kill(os.getpid(), getattr(signal, args.signal))
    if attempt <= args.oom_attempts:
        print("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr, flush=True)
        return 1
    if attempt <= args.fail_attempts:
        print(f"failing on purpose at attempt {attempt}", file=sys.stderr, flush=True)
        return 3
    if args.exit_code:
        return args.exit_code
    if args.output == "true":
        with open(os.path.join(args.output_dir, "out.txt"), "w") as f:
            f.write(f"done {job}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
