"""A test model that really takes GPU memory (PyTorch on CUDA) and says where it ran.

One-shot: `--input I --output-dir D --hold-mb N --sleep S --trace F` allocates N MB on the GPU it
was given, keeps it for S seconds, appends a JSON line to F and writes out.txt.
Persistent: `--serve --hold-mb N --trace F` allocates N MB once, at load, keeps it while warm, and
answers each job (params: sleep) with the same trace line and out.txt.

The trace line: job, pid, start and end (epoch seconds), CUDA_VISIBLE_DEVICES, the UUID of the
device torch sees as cuda:0, and the bytes it holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MB = 1 << 20


def take(torch: Any, hold_mb: int) -> Any:
    """Allocate and touch `hold_mb` MB on cuda:0 (cudaMalloc through torch's allocator)."""
    block = torch.empty(hold_mb * MB, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    return block


def record(trace: str, job: str, started: float, held: Any, torch: Any) -> None:
    line = {
        "job": job,
        "pid": os.getpid(),
        "start": started,
        "end": time.time(),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "uuid": str(torch.cuda.get_device_properties(0).uuid),
        "held_mb": held.numel() // MB,
    }
    with open(trace, "a") as f:
        f.write(json.dumps(line) + "\n")


def oneshot(args: argparse.Namespace) -> int:
    import torch

    started = time.time()
    held = take(torch, args.hold_mb)
    time.sleep(args.sleep)
    record(args.trace, os.environ.get("GPUJOBS_JOB", "?"), started, held, torch)
    Path(args.output_dir, "out.txt").write_text("held\n")
    return 0


def serve(args: argparse.Namespace) -> int:
    from app import modelkit

    def load() -> tuple[Any, Any]:
        import torch

        return torch, take(torch, args.hold_mb)

    def handle(model: tuple[Any, Any], job: modelkit.Job) -> None:
        torch, held = model
        started = time.time()
        time.sleep(float(job.params.get("sleep", 0.0)))
        record(args.trace, job.id, started, held, torch)
        (job.output_dir / "out.txt").write_text("held\n")

    return modelkit.serve(load, handle, name="cuda_hog")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--input")
    parser.add_argument("--output-dir")
    parser.add_argument("--hold-mb", type=int, required=True)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--trace", required=True)
    args = parser.parse_args()
    return serve(args) if args.serve else oneshot(args)


if __name__ == "__main__":
    sys.exit(main())
