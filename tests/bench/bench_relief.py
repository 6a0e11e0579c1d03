"""relief's "Speed" table in docs/models.md, measured: one-shot `python -m app.relief` runs on the CPU.

Run on demand: `.venv/bin/python -m tests.bench.bench_relief [--repeat N] [--work-dir DIR]`. It prints,
asserts nothing; about a minute a round on 2 cores. Progress goes to stderr, the tables to stdout.

Each run is one process started the way a worker's one-shot mode starts it (app/queue/attempt.py):
the argv from the built-in registry entry (`ModelSpec.build_argv`, every parameter rendered, defaults
filled in) with `--device auto` turned into `--device cpu`, so the numpy path runs even where PyTorch
and a GPU are present; the working folder a lane holding `input.png` or `input.jpg` and an `out/`
folder emptied before each run; the environment `runner.minimal_env` with no GPU
(`CUDA_VISIBLE_DEVICES` empty), HOME and TMPDIR in the lane, and PYTHONPATH this checkout;
stdin from /dev/null, a session of its own. stdout and stderr come back on one pipe, as a worker's
log holds them, and each line is timestamped as it arrives. Unlike a worker, nothing copies the
input in or publishes the output: the time is the model process's alone.

The inputs are made afresh in `--work-dir` (default: a temporary folder removed at the end), in a
separate process, and are the same bytes for the same numpy and Pillow: photo-like RGB pictures
(smooth colour gradients, a few broad hills and hollows, 40 flat-coloured ellipses, rectangles and
triangles, Gaussian grain of sigma 6 levels), 1000 x 1000 as PNG and 8000 x 6000 (48 megapixels)
as JPEG of quality 90, seeded. Their size and the start of their SHA-256 are printed.

Rows are run round-robin, `--repeat` rounds (default 3), after one untimed warm-up run of row 1.
First the machine: Python, numpy, Pillow and trimesh versions, cores (all / usable by this
process), load average at the start and at the end, and this process's own peak RSS (Linux
carries a parent's peak over fork and exec into the child's, so it is the floor of every RSS
figure). Then per row:

- median s, min s: wall time of the whole process, from Popen to its reaping (os.wait4), Python
  start-up and exit included: what the docs' "time" column claims.
- peak RSS MB: the most over the rounds of the child's own ru_maxrss (from os.wait4), in 10^6 bytes.
- faces: from relief's last stderr line (`relief: wrote ... (N faces)`): `len(mesh.faces)` as saved.
- file MB: size of `mesh.<format>`, in 10^6 bytes.
- device: what relief printed (`relief: device ...`); "cpu (numpy)" on every row means no CUDA.

The second table splits the median run at relief's progress lines, as the bench saw them arrive:
start (interpreter, imports, backend, decoding the image) up to `0.1 loaded`; `0.4 heightmap`
(luminance, box reduction, resampling and blur); `0.7 mesh` (building the solid); `1.0 written`
(trimesh's export, the write and fsync); exit (after the last line until the process is reaped).
Last, the STL and OBJ rows over the GLB row at resolution 1024: medians of the whole process, and
of the write phase alone.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from app import modelsfile, registry, runner

ROOT = Path(__file__).resolve().parents[2]
PNG = "photo-1000x1000.png"
JPEG = "photo-8000x6000.jpg"
PHASES = ("loaded", "heightmap", "mesh", "written")  # relief's progress messages, in order


@dataclass(frozen=True, slots=True)
class Case:
    """One row of the docs' table: an input and the job's params."""

    input_label: str
    input_name: str
    settings: str
    params: dict[str, registry.Value]


CASES = (
    Case("1000x1000 PNG", PNG, "defaults (GLB, resolution 256)", {}),
    Case("1000x1000 PNG", PNG, "resolution 1024, GLB", {"resolution": 1024}),
    Case(
        "8000x6000 JPEG", JPEG, "resolution 1024, smoothing 10, GLB", {"resolution": 1024, "smoothing": 10.0}
    ),
    Case("1000x1000 PNG", PNG, "resolution 1024, STL", {"resolution": 1024, "format": "stl"}),
    Case("1000x1000 PNG", PNG, "resolution 1024, OBJ", {"resolution": 1024, "format": "obj"}),
)
GLB_1024, STL_1024, OBJ_1024 = 1, 3, 4  # indexes into CASES for the ratios


@dataclass(frozen=True, slots=True)
class Run:
    """What one relief process did."""

    wall_s: float
    maxrss_mb: float
    phases_s: tuple[float, ...]  # start..loaded, ..heightmap, ..mesh, ..written, ..reaped
    device: str
    faces: int | None
    file_mb: float


# -- inputs (made in a process of its own: this one's peak RSS is every child's floor) ---------


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like RGB picture: smooth gradients and hills, flat shapes, grain."""
    rng = np.random.default_rng(seed)
    small = _smooth(rng, max(width // 8, 16), max(height // 8, 16))
    img = small.resize((width, height), Image.Resampling.BICUBIC)
    _shapes(ImageDraw.Draw(img), rng, width, height)
    return _grain(img, rng, sigma=6.0)


def _smooth(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Colour gradients, a ripple and hills shared by the channels, each channel tinted its own way."""
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    field = 0.15 * np.sin(rng.uniform(3, 12) * x + rng.uniform(0, 6.3)) * np.cos(rng.uniform(3, 12) * y)
    for _ in range(6):  # hills and hollows
        cx, cy, r = rng.uniform(0, x.max()), rng.uniform(0, y.max()), rng.uniform(0.05, 0.2)
        field += rng.uniform(-0.3, 0.3) * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))
    planes = [
        0.5 + rng.uniform(-0.3, 0.3) * x + rng.uniform(-0.3, 0.3) * y + rng.uniform(0.6, 1.0) * field
        for _ in range(3)
    ]
    rgb = np.clip(np.stack(planes, axis=-1), 0.0, 1.0) * 255
    return Image.fromarray(rgb.round().astype(np.uint8))


def _shapes(draw: ImageDraw.ImageDraw, rng: np.random.Generator, width: int, height: int) -> None:
    """40 flat-coloured ellipses, rectangles and triangles, 3-20 % of the longer side."""
    side = max(width, height)
    for _ in range(40):
        x0, y0 = rng.uniform(0, width), rng.uniform(0, height)
        w, h = rng.uniform(0.03, 0.2, 2) * side
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        kind = int(rng.integers(3))
        if kind == 0:
            draw.ellipse((x0, y0, x0 + w, y0 + h), fill=fill)
        elif kind == 1:
            draw.rectangle((x0, y0, x0 + w, y0 + h), fill=fill)
        else:
            draw.polygon([(x0, y0 + h), (x0 + w / 2, y0), (x0 + w, y0 + h)], fill=fill)


def _grain(img: Image.Image, rng: np.random.Generator, sigma: float, band_rows: int = 512) -> Image.Image:
    """Gaussian noise of `sigma` levels, added a band of rows at a time to bound memory."""
    pixels = np.array(img)  # a writable copy, (height, width, 3) uint8
    for top in range(0, pixels.shape[0], band_rows):
        band = pixels[top : top + band_rows]
        noisy = band + sigma * rng.standard_normal(band.shape, dtype=np.float32)
        band[...] = np.clip(noisy, 0, 255).round().astype(np.uint8)
    return Image.fromarray(pixels)


def make_inputs(folder: str) -> list[str]:
    """Write both inputs into `folder`; one description line each."""
    lines = []
    for name, (width, height), seed in ((PNG, (1000, 1000), 1), (JPEG, (8000, 6000), 2)):
        path = Path(folder) / name
        img = picture(width, height, seed)
        if name.endswith(".jpg"):
            img.save(path, format="JPEG", quality=90)
        else:
            img.save(path, format="PNG")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
        size_mb = path.stat().st_size / 1e6
        lines.append(f"{name}: {width}x{height} RGB, {size_mb:.2f} MB, sha256 {digest}...")
    return lines


# -- runs ------------------------------------------------------------------------------------


def relief_argv(spec: registry.ModelSpec, case: Case, lane: Path) -> list[str]:
    """The worker's command line for this case, but on the CPU."""
    input_path = lane / f"input{Path(case.input_name).suffix}"
    argv = spec.build_argv(case.params, input_path=input_path, output_dir=lane / "out", python=sys.executable)
    try:
        at = argv.index("--device") + 1
    except ValueError:
        raise SystemExit("the registry's relief argv has no --device: cannot force the CPU") from None
    argv[at] = "cpu"
    return argv


def lane_env(lane: Path) -> dict[str, str]:
    """The environment of a worker's one-shot run (app/queue/oneshot.py), without a GPU."""
    folder = str(lane)
    extra = {"HOME": folder, "TMPDIR": folder, "TMP": folder, "TEMP": folder, "PYTHONPATH": str(ROOT)}
    return runner.minimal_env(None, extra)


def run_once(argv: list[str], lane: Path) -> Run:
    """Start relief, timestamp its output lines, reap it with its own rusage."""
    shutil.rmtree(lane / "out", ignore_errors=True)
    lines: list[tuple[float, str]] = []
    started = time.perf_counter()
    popen = subprocess.Popen(
        argv, cwd=lane, env=lane_env(lane), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    assert popen.stdout is not None
    with popen.stdout:
        for raw in popen.stdout:
            lines.append((time.perf_counter() - started, raw.decode(errors="replace").rstrip()))
    _, status, usage = os.wait4(popen.pid, 0)
    wall_s = time.perf_counter() - started
    popen.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait
    (lane / "relief.log").write_text("".join(f"{t:8.3f} {line}\n" for t, line in lines))
    if popen.returncode != 0:
        tail = "\n".join(line for _, line in lines[-10:])
        raise SystemExit(f"relief exited {popen.returncode}:\n{tail}")
    return _read(lines, wall_s, usage.ru_maxrss * 1024 / 1e6, lane / "out")


def _read(lines: list[tuple[float, str]], wall_s: float, maxrss_mb: float, out: Path) -> Run:
    """A Run from the timestamped output lines and the written mesh."""
    marks = {
        line.split()[2]: t for t, line in lines if line.startswith("PROGRESS ") and len(line.split()) > 2
    }
    times = [0.0, *(marks.get(phase, float("nan")) for phase in PHASES), wall_s]
    device, faces = "?", None
    for _, line in lines:
        if line.startswith("relief: device "):
            device = line.removeprefix("relief: device ")
        elif line.startswith("relief: wrote ") and line.endswith(" faces)"):
            faces = int(line.rsplit("(", 1)[1].split()[0])
    (mesh,) = out.glob("mesh.*")
    phases = tuple(b - a for a, b in itertools.pairwise(times))
    return Run(wall_s, maxrss_mb, phases, device, faces, mesh.stat().st_size / 1e6)


def measure(work: Path, repeat: int) -> list[list[Run]]:
    """Every case `repeat` times, round-robin, after one untimed run of the first."""
    spec = modelsfile.load_registry().get("relief")
    argvs = []
    for i, case in enumerate(CASES, start=1):
        lane = work / "lanes" / f"row{i}"
        lane.mkdir(parents=True, exist_ok=True)
        argv = relief_argv(spec, case, lane)
        shutil.copyfile(work / case.input_name, argv[argv.index("--input") + 1])
        argvs.append((argv, lane))
    print(f"warm-up: row 1 ({run_once(*argvs[0]).wall_s:.2f} s, not counted)", file=sys.stderr)
    runs: list[list[Run]] = [[] for _ in CASES]
    for round_ in range(1, repeat + 1):
        for i, (argv, lane) in enumerate(argvs):
            runs[i].append(run_once(argv, lane))
            print(f"round {round_}/{repeat}, row {i + 1}: {runs[i][-1].wall_s:.2f} s", file=sys.stderr)
    return runs


# -- printing --------------------------------------------------------------------------------


def _machine(argv_row1: str) -> None:
    """Versions, cores, load; the command line of row 1."""
    versions = ", ".join(f"{name} {metadata.version(name)}" for name in ("numpy", "Pillow", "trimesh"))
    print(f"Python {sys.version.split()[0]}, {versions}")
    print(f"cores: {os.cpu_count()} (usable here: {len(os.sched_getaffinity(0))})")
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}")
    print(f"row 1 runs: {argv_row1}")


def _tables(runs: list[list[Run]]) -> None:
    """The docs' table, the phases of the median run, the format ratios."""
    print(f"\n{'row':<4}{'input':<16}{'settings':<36}{'median s':>9}{'min s':>7}{'peak RSS MB':>13}"
          f"{'faces':>11}{'file MB':>9}  device")  # fmt: skip
    for i, (case, row) in enumerate(zip(CASES, runs, strict=True), start=1):
        walls = [r.wall_s for r in row]
        faces = f"{row[-1].faces:,}" if row[-1].faces is not None else "?"
        devices = "/".join(sorted({r.device for r in row}))
        print(f"{i:<4}{case.input_label:<16}{case.settings:<36}{statistics.median(walls):>9.2f}"
              f"{min(walls):>7.2f}{max(r.maxrss_mb for r in row):>13.0f}{faces:>11}"
              f"{row[-1].file_mb:>9.1f}  {devices}")  # fmt: skip
    print(f"\nmedian run, split at the progress lines (s)\n{'row':<4}{'start+decode':>13}{'heightmap':>10}"
          f"{'mesh':>7}{'write':>7}{'exit':>7}")  # fmt: skip
    for i, row in enumerate(runs, start=1):
        median_run = sorted(row, key=lambda r: r.wall_s)[(len(row) - 1) // 2]
        print(
            f"{i:<4}"
            + "".join(f"{s:>{w}.2f}" for s, w in zip(median_run.phases_s, (13, 10, 7, 7, 7), strict=True))
        )
    glb = runs[GLB_1024]
    for name, index in (("STL", STL_1024), ("OBJ", OBJ_1024)):
        whole = _median_ratio(runs[index], glb, lambda r: r.wall_s)
        write = _median_ratio(runs[index], glb, lambda r: r.phases_s[3])
        print(
            f"{name} / GLB at resolution 1024: {whole:.2f}x the whole process, {write:.2f}x the write phase"
        )


def _median_ratio(top: list[Run], bottom: list[Run], figure: Callable[[Run], float]) -> float:
    """median(figure over top) / median(figure over bottom)."""
    return statistics.median(map(figure, top)) / statistics.median(map(figure, bottom))


def main() -> None:
    """Parse the arguments, make the inputs, measure, print."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.bench_relief", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds of every row (default 3)")
    parser.add_argument(
        "--work-dir", type=Path, help="keep inputs, lanes and logs here (default: a temp folder)"
    )
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="gpujobs-relief-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print(f"making the inputs in {work}", file=sys.stderr)
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            inputs = pool.submit(make_inputs, str(work)).result()
        spec = modelsfile.load_registry().get("relief")
        _machine(" ".join(relief_argv(spec, CASES[0], Path("LANE"))).replace(sys.executable, "PYTHON"))
        print("inputs: " + "; ".join(inputs))
        runs = measure(work, args.repeat)
        own_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6
        print(f"this process's peak RSS (the floor of every child's): {own_mb:.0f} MB")
        _tables(runs)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
