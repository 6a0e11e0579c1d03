"""`python -m app.relief --serve [--device auto]`: the relief model as a warm runner.

The backend (PyTorch and its CUDA context, when present) is loaded once; each job then reads
its image and writes `mesh.<format>` as the one-shot CLI does. Job params have the registry's
names (format, width_mm, depth_mm, base_mm, resolution, invert, smoothing, mask) and are checked
like the CLI's arguments; a bad one fails the job as bad input. See docs/persistent.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from PIL import Image

from app import modelkit
from app.relief import errors, heightmap, mesh, params, picture, pipeline

_FLOATS = ("width_mm", "depth_mm", "base_mm", "smoothing")


def main(argv: Sequence[str] | None = None) -> int:
    """Serve jobs until stdin closes; return the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m app.relief --serve", description=__doc__)
    parser.add_argument("--serve", action="store_true", required=True, help="run as a warm runner")
    parser.add_argument(
        "--device", choices=[d.value for d in params.Device], default=params.Device.AUTO.value
    )
    args = parser.parse_args(argv)
    return modelkit.serve(lambda: load(args.device), handle, name="relief", bad_input=(errors.BadInput,))


def load(device: str) -> heightmap.Backend:
    """Pick and initialise the backend once (DeviceUnavailable ends the runner before ready)."""
    Image.MAX_IMAGE_PIXELS = picture.MAX_PIXELS
    backend = pipeline.load(device)
    print(f"relief: device {backend.name}", file=sys.stderr, flush=True)
    return backend


def handle(backend: heightmap.Backend, job: modelkit.Job) -> list[str]:
    """Turn the job's image into a mesh file in its output folder."""
    file_format, relief = job_params(job.params)
    image = picture.open_image(job.input)
    job.progress(0.1, "loaded")
    result = pipeline.build_mesh(image, relief, backend, job.progress)
    path = mesh.save(result, job.output_dir, file_format)
    job.progress(1.0, "written")
    print(f"relief: wrote {path} ({len(result.faces)} faces)", file=sys.stderr, flush=True)
    return [path.name]


def job_params(raw: Mapping[str, Any]) -> tuple[str, params.ReliefParams]:
    """The mesh format and geometry a job asks for; BadInput names the first bad parameter."""
    known = {"format", "resolution", "invert", "mask", *_FLOATS}
    for name in sorted(set(raw) - known):
        raise modelkit.BadInput(f"params.{name}: unknown parameter (known: {', '.join(sorted(known))})")
    file_format = raw.get("format", "glb")
    mask = raw.get("mask", params.MaskMode.AUTO.value)
    if file_format not in mesh.FORMATS:
        raise modelkit.BadInput(f"params.format: must be one of {', '.join(mesh.FORMATS)}")
    if mask not in [m.value for m in params.MaskMode]:
        raise modelkit.BadInput(f"params.mask: must be one of {', '.join(m.value for m in params.MaskMode)}")
    values: dict[str, Any] = {name: _number(raw, name) for name in _FLOATS if name in raw}
    if "resolution" in raw:
        values["resolution"] = _typed(raw, "resolution", int)
    if "invert" in raw:
        values["invert"] = _typed(raw, "invert", bool)
    try:
        return str(file_format), params.ReliefParams(**values, mask=params.MaskMode(mask))
    except ValueError as exc:
        raise modelkit.BadInput(f"params: {exc}") from None


def _number(raw: Mapping[str, Any], name: str) -> float:
    """raw[name] as a float; BadInput for a JSON number that is none (an integer past its range)."""
    try:
        return float(_typed(raw, name, (int, float)))
    except OverflowError:
        raise modelkit.BadInput(f"params.{name}: out of range") from None


def _typed(raw: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """raw[name] when it has the JSON type asked for (a bool is no number); BadInput otherwise."""
    value = raw[name]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise modelkit.BadInput(f"params.{name}: {value!r} has the wrong type")
    return value
