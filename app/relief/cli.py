"""`python -m app.relief`: argument parsing, progress lines and exit codes around the pipeline."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

from PIL import Image

from app.relief import errors, mesh, params, picture, pipeline

EXIT_OK = 0
EXIT_USAGE = 64  # sysexits EX_USAGE: bad arguments, or a device that cannot be used
EXIT_BAD_INPUT = 65  # sysexits EX_DATAERR: the image cannot become a mesh; retrying will not help


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors exit 64 rather than argparse's 2."""

    def error(self, message: str) -> NoReturn:
        """Print usage and the problem to stderr, then exit 64."""
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _flag(text: str) -> bool:
    """Parse true/false (as the service renders booleans), also yes/no and 1/0."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "1"):
        return True
    if lowered in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parser() -> _Parser:
    """The command line; defaults come from ReliefParams so there is one source for them."""
    default = params.ReliefParams()
    parser = _Parser(prog="python -m app.relief", description="Turn an image into a 3D relief mesh.")
    add = parser.add_argument
    add("--input", type=Path, required=True, help="image file (PNG, JPEG, WebP, TIFF, ...)")
    add("--output-dir", type=Path, required=True, help="folder that receives mesh.<format>")
    add("--format", choices=mesh.FORMATS, default="glb", help="mesh file format (default glb)")
    add("--width-mm", type=float, default=default.width_mm, help="size along the longer image side")
    add("--depth-mm", type=float, default=default.depth_mm, help="relief height above the base")
    add("--base-mm", type=float, default=default.base_mm, help="thickness of the flat base")
    add("--resolution", type=int, default=default.resolution, help="grid cells along the longer side")
    add("--invert", type=_flag, nargs="?", const=True, default=default.invert, help="dark is high")
    add("--smoothing", type=float, default=default.smoothing, help="Gaussian blur radius in cells")
    add("--mask", choices=[m.value for m in params.MaskMode], default=default.mask.value)
    add(
        "--device",
        choices=[d.value for d in params.Device],
        metavar="{auto,cpu,cuda}",  # torch-cpu exists for tests only
        default=params.Device.AUTO.value,
    )
    return parser


def _progress(fraction: float, message: str) -> None:
    """Emit one `PROGRESS <fraction> <message>` line for the service."""
    print(f"PROGRESS {round(fraction, 3)} {message}", flush=True)


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Turn the service's SIGTERM into SystemExit so cleanup (temporary files) runs."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the model once; return the process exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        relief = params.ReliefParams(
            width_mm=args.width_mm,
            depth_mm=args.depth_mm,
            base_mm=args.base_mm,
            resolution=args.resolution,
            invert=args.invert,
            smoothing=args.smoothing,
            mask=params.MaskMode(args.mask),
        )
    except ValueError as exc:
        parser.error(str(exc))
    Image.MAX_IMAGE_PIXELS = picture.MAX_PIXELS
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return _run(args.input, args.output_dir, args.format, args.device, relief)
    except errors.BadInput as exc:
        print(f"relief: bad input: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except errors.DeviceUnavailable as exc:
        print(f"relief: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _run(source: Path, out_dir: Path, file_format: str, device: str, relief: params.ReliefParams) -> int:
    """Load, build, write, reporting progress on stdout and diagnostics on stderr."""
    backend = pipeline.load(device)
    print(f"relief: device {backend.name}", file=sys.stderr, flush=True)
    image = picture.open_image(source)
    _progress(0.1, "loaded")
    result = pipeline.build_mesh(image, relief, backend, _progress)
    path = mesh.save(result, out_dir, file_format)
    _progress(1.0, "written")
    print(f"relief: wrote {path} ({len(result.faces)} faces)", file=sys.stderr)
    return EXIT_OK
