"""The relief reference model, run the way the service runs it: a subprocess on real image files."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import trimesh
from PIL import Image, ImageOps

from app import modelkit, relief
from app.relief import errors as relief_errors
from app.relief import heightmap, mesh, picture, serve, torch_backend

ROOT = Path(__file__).resolve().parents[2]
PROGRESS_LINE = re.compile(r"^PROGRESS (?P<fraction>[01](?:\.\d+)?) (?P<message>\S.*)$")


def run_relief(
    source: Path, out: Path, *args: str, device: str = "cpu", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `python -m app.relief` like the service does, on the numpy path unless told otherwise."""
    paths = ["--input", str(source), "--output-dir", str(out)]
    return subprocess.run(
        [sys.executable, "-m", "app.relief", *paths, "--device", device, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def load_mesh(path: Path) -> trimesh.Trimesh:
    """Read a mesh file back as one mesh, the way a consumer would."""
    loaded = trimesh.load(path, force="mesh")
    assert isinstance(loaded, trimesh.Trimesh)
    return loaded


def assert_printable(result: trimesh.Trimesh) -> None:
    """Closed, consistently wound, positive volume, flat on z=0."""
    assert result.is_watertight
    assert result.is_winding_consistent
    assert result.volume > 0
    assert result.bounds[0][2] == pytest.approx(0.0)


def top_z_at_x(result: trimesh.Trimesh, x: float) -> float:
    """Highest z among the vertices in the column at x."""
    column = np.abs(result.vertices[:, 0] - x) < 1e-6
    return float(result.vertices[column, 2].max())


@pytest.fixture
def gradient(tmp_path: Path) -> Path:
    """A 64x32 landscape PNG, black on the left to white on the right."""
    ramp = np.linspace(0, 255, 64, dtype=np.float64)[None, :].repeat(32, axis=0)
    path = tmp_path / "gradient.png"
    Image.fromarray(ramp.astype(np.uint8), "L").save(path)
    return path


@pytest.fixture
def framed(tmp_path: Path) -> Path:
    """A 64x64 RGBA PNG: an opaque 32x32 square inside a fully transparent 16 px border."""
    pixels = np.zeros((64, 64, 4), dtype=np.uint8)
    pixels[..., :3] = np.linspace(0, 255, 64, dtype=np.float64)[None, :, None].astype(np.uint8)
    pixels[16:48, 16:48, 3] = 255
    path = tmp_path / "framed.png"
    Image.fromarray(pixels, "RGBA").save(path)
    return path


def test_gradient_glb_is_a_printable_solid_of_the_asked_size(gradient: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    sizes = ["--width-mm", "80", "--depth-mm", "4", "--base-mm", "1.5"]
    done = run_relief(gradient, out, *sizes, "--resolution", "64")
    assert done.returncode == 0, done.stderr
    assert [p.name for p in out.iterdir()] == ["mesh.glb"]  # no temporary file left behind
    result = load_mesh(out / "mesh.glb")
    assert_printable(result)
    (x0, y0, _), (x1, y1, z1) = result.bounds
    assert (x1 - x0, y1 - y0, z1) == (pytest.approx(80.0), pytest.approx(40.0), pytest.approx(5.5))
    assert top_z_at_x(result, 0.0) == pytest.approx(1.5, abs=0.05)  # dark is low
    assert top_z_at_x(result, 80.0) == pytest.approx(5.5, abs=0.05)
    assert "device cpu" in done.stderr


def test_progress_lines_parse_and_end_at_one(gradient: Path, tmp_path: Path) -> None:
    done = run_relief(gradient, tmp_path / "out", "--resolution", "16")
    assert done.returncode == 0, done.stderr
    matches = [PROGRESS_LINE.match(line) for line in done.stdout.splitlines()]
    assert all(matches), done.stdout
    fractions = [float(m["fraction"]) for m in matches if m]
    assert fractions == sorted(fractions)
    assert fractions[-1] == 1.0
    assert [m["message"] for m in matches if m] == ["loaded", "heightmap", "mesh", "written"]


@pytest.mark.parametrize("file_format", ["stl", "obj"])
def test_other_formats_are_printable_too(gradient: Path, tmp_path: Path, file_format: str) -> None:
    out = tmp_path / "out"
    done = run_relief(gradient, out, "--format", file_format, "--resolution", "32")
    assert done.returncode == 0, done.stderr
    result = load_mesh(out / f"mesh.{file_format}")
    assert_printable(result)
    assert result.extents == pytest.approx([100.0, 50.0, 7.0])


def test_invert_makes_dark_high(gradient: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_relief(gradient, out, "--resolution", "32", "--invert", "true")
    assert done.returncode == 0, done.stderr
    result = load_mesh(out / "mesh.glb")
    assert_printable(result)
    assert top_z_at_x(result, 0.0) == pytest.approx(7.0, abs=0.05)
    assert top_z_at_x(result, 100.0) == pytest.approx(2.0, abs=0.05)


@pytest.mark.parametrize("invert", ["false", "true"])
def test_a_flat_image_is_a_slab_of_base_thickness(tmp_path: Path, invert: str) -> None:
    """docs/models.md: a flat image gives a flat slab base_mm thick. With --invert true it was
    base + depth thick (7 mm): the flat level 0 was inverted to 1."""
    source = tmp_path / "flat.png"
    Image.new("L", (32, 32), 90).save(source)
    done = run_relief(source, tmp_path / "out", "--resolution", "16", "--invert", invert)
    assert done.returncode == 0, done.stderr
    result = load_mesh(tmp_path / "out/mesh.glb")
    assert_printable(result)
    assert result.extents == pytest.approx([100.0, 100.0, 2.0])


def test_transparent_border_is_cut_away(framed: Path, tmp_path: Path) -> None:
    cut = run_relief(framed, tmp_path / "cut", "--resolution", "64")
    whole = run_relief(framed, tmp_path / "whole", "--resolution", "64", "--mask", "none")
    assert cut.returncode == whole.returncode == 0, cut.stderr + whole.stderr
    cut_mesh, whole_mesh = load_mesh(tmp_path / "cut/mesh.glb"), load_mesh(tmp_path / "whole/mesh.glb")
    assert_printable(cut_mesh)
    assert len(cut_mesh.faces) < len(whole_mesh.faces)
    assert whole_mesh.extents[:2] == pytest.approx([100.0, 100.0])
    # Only the opaque middle half remains, give or take the cell on each edge where alpha is mixed.
    assert cut_mesh.extents[:2] == pytest.approx([50.0, 50.0], abs=100 / 64 + 1e-6)


def write_png16(path: Path, pixels: np.ndarray, key: tuple[int, ...]) -> None:
    """A 16-bit PNG (grey for 2-D pixels, RGB for 3-D) with a tRNS colour key, written byte by byte:
    Pillow cannot write 16-bit colour."""
    height, width = pixels.shape[:2]
    colour_type = 0 if pixels.ndim == 2 else 2
    rows = b"".join(b"\x00" + pixels[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"tRNS", struct.pack(f">{len(key)}H", *key))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + body + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def framed16(colour: bool, key: int = 1000) -> np.ndarray:
    """64x64 16-bit pixels: a ramp in the middle 32x32, a border of the key colour."""
    pixels = np.full((64, 64), key, dtype=np.uint16)
    pixels[16:48, 16:48] = np.linspace(2000, 60000, 32, dtype=np.float64)[None, :].astype(np.uint16)
    return np.stack([pixels] * 3, axis=-1) if colour else pixels


@pytest.mark.parametrize("mask", ["auto", "alpha"])
def test_a_16_bit_grey_pngs_colour_key_cuts_the_mesh(tmp_path: Path, mask: str) -> None:
    """A 16-bit greyscale PNG's transparent colour (tRNS) was ignored, even under --mask alpha:
    Pillow's RGBA conversion drops it for I;16, and the transparent border was meshed."""
    source = tmp_path / "key16.png"
    write_png16(source, framed16(colour=False), (1000,))
    done = run_relief(source, tmp_path / "out", "--resolution", "64", "--mask", mask)
    assert done.returncode == 0, done.stderr
    cut = load_mesh(tmp_path / "out/mesh.glb")
    assert_printable(cut)
    assert cut.extents[:2] == pytest.approx([50.0, 50.0], abs=100 / 64 + 1e-6)


@pytest.mark.parametrize("mask", ["auto", "alpha"])
@pytest.mark.parametrize("key", [1000, 200])  # 200: a key that an 8-bit colour could have
def test_a_16_bit_colour_pngs_colour_key_is_bad_input(tmp_path: Path, mask: str, key: int) -> None:
    """Pillow reads 16-bit colour at 8 bits but keeps the key at 16, so no pixel matched it and the
    transparent border was meshed (exit 0). The key cannot be applied: bad input, saying why."""
    source = tmp_path / "key16.png"
    write_png16(source, framed16(colour=True, key=key), (key, key, key))
    done = run_relief(source, tmp_path / "out", "--resolution", "64", "--mask", mask)
    assert done.returncode == 65, done.stderr
    assert "--mask none" in done.stderr
    whole = run_relief(source, tmp_path / "whole", "--resolution", "64", "--mask", "none")
    assert whole.returncode == 0, whole.stderr


@pytest.mark.parametrize("value", [2e38, 3e38, float(np.finfo(np.float32).max)])
def test_extreme_float_images_mesh_without_nan(tmp_path: Path, value: float) -> None:
    """A float TIFF checkerboard of +-2e38 gave NaN vertices (exit 0): the normalisation's
    `values - low` overflowed float32 to inf, and inf / inf is NaN."""
    pixels = np.full((32, 32), value, dtype=np.float32)
    pixels[::2, ::2] = -value
    source = tmp_path / "extreme.tif"
    Image.fromarray(pixels, "F").save(source)
    built = relief.build_mesh(picture.open_image(source), relief.ReliefParams(resolution=64))
    assert np.isfinite(built.vertices).all()
    done = run_relief(source, tmp_path / "out", "--format", "stl", "--resolution", "64")
    assert done.returncode == 0, done.stderr
    result = load_mesh(tmp_path / "out/mesh.stl")
    assert np.isfinite(result.vertices).all()
    assert_printable(result)
    assert result.bounds[1][2] == pytest.approx(7.0)  # the default base 2 and depth 5, at the top


def test_a_16_bit_grey_png_keeps_its_low_bits(tmp_path: Path) -> None:
    """docs/models.md: 16-bit greyscale is read at full precision (a ramp over raw 0..255 of 65535,
    all in the low byte, still spans the whole depth); 16-bit colour, which Pillow reads at 8 bits
    a channel, the doc had claimed too."""
    source = tmp_path / "low16.png"
    Image.fromarray(np.tile(np.arange(256, dtype=np.uint16), (16, 1))).save(source)
    done = run_relief(source, tmp_path / "out", "--resolution", "64", "--smoothing", "0")
    assert done.returncode == 0, done.stderr
    result = load_mesh(tmp_path / "out/mesh.glb")
    assert top_z_at_x(result, 0.0) == pytest.approx(2.0, abs=0.05)
    assert top_z_at_x(result, 100.0) == pytest.approx(7.0, abs=0.05)


def test_portrait_image_spans_width_along_y(tmp_path: Path) -> None:
    source = tmp_path / "portrait.png"
    Image.fromarray(np.tile(np.arange(0, 240, 6, dtype=np.uint8)[:, None], (1, 20)), "L").save(source)
    done = run_relief(source, tmp_path / "out", "--width-mm", "60")
    assert done.returncode == 0, done.stderr
    result = load_mesh(tmp_path / "out/mesh.glb")
    assert_printable(result)
    assert result.extents[:2] == pytest.approx([30.0, 60.0])


def test_corrupt_image_is_bad_input_and_leaves_no_mesh(tmp_path: Path) -> None:
    source = tmp_path / "broken.png"
    source.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    out = tmp_path / "out"
    done = run_relief(source, out)
    assert done.returncode == 65
    assert "bad input" in done.stderr
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize(
    ("image", "extra"),
    [
        (Image.new("RGBA", (16, 16), (255, 255, 255, 0)), []),  # nothing opaque
        (Image.new("RGB", (16, 16), (9, 9, 9)), ["--mask", "alpha"]),  # no alpha to cut by
    ],
    ids=["empty-mask", "alpha-without-alpha"],
)
def test_unusable_images_are_bad_input(tmp_path: Path, image: Image.Image, extra: list[str]) -> None:
    source = tmp_path / "input.png"
    image.save(source)
    done = run_relief(source, tmp_path / "out", *extra)
    assert done.returncode == 65, done.stderr
    assert not (tmp_path / "out/mesh.glb").exists()


@pytest.mark.parametrize(
    "bad",
    [["--resolution", "8"], ["--format", "ply"], ["--invert", "maybe"], ["--bogus"]],
    ids=["out-of-range", "bad-choice", "bad-bool", "unknown-flag"],
)
def test_bad_arguments_exit_64(gradient: Path, tmp_path: Path, bad: list[str]) -> None:
    done = run_relief(gradient, tmp_path / "out", *bad)
    assert done.returncode == 64
    assert "error:" in done.stderr


def test_cuda_without_cuda_exits_64(gradient: Path, tmp_path: Path) -> None:
    try:
        if torch_backend.import_torch().cuda.is_available():
            pytest.skip("this machine has CUDA")
    except relief_errors.DeviceUnavailable:
        pass  # no usable PyTorch: no CUDA either
    done = run_relief(gradient, tmp_path / "out", device="cuda")
    assert done.returncode == 64
    assert "cuda" in done.stderr


@pytest.fixture
def broken_torch(tmp_path: Path) -> dict[str, str]:
    """An environment whose `import torch` fails like a CUDA install missing a library."""
    package = tmp_path / "site" / "torch"
    package.mkdir(parents=True)
    message = "libcudnn.so.9: cannot open shared object file: No such file or directory"
    (package / "__init__.py").write_text(f"raise OSError({message!r})\n")
    return {**os.environ, "PYTHONPATH": str(tmp_path / "site")}


def test_auto_device_falls_back_to_numpy_when_torch_fails_to_load(
    gradient: Path, tmp_path: Path, broken_torch: dict[str, str]
) -> None:
    """docs/models.md: `--device auto` uses numpy when PyTorch cannot be used. An `import torch`
    failing with OSError (a missing libcudnn) escaped as a crash, exit 1, retried as one."""
    done = run_relief(gradient, tmp_path / "out", "--resolution", "16", device="auto", env=broken_torch)
    assert done.returncode == 0, done.stderr
    assert "device cpu (numpy)" in done.stderr
    assert (tmp_path / "out/mesh.glb").exists()


def test_cuda_with_a_broken_torch_exits_64_with_the_reason(
    gradient: Path, tmp_path: Path, broken_torch: dict[str, str]
) -> None:
    """`--device cuda` with a torch that cannot load is an unusable device (64), and says why."""
    done = run_relief(gradient, tmp_path / "out", device="cuda", env=broken_torch)
    assert done.returncode == 64, done.stderr
    assert "libcudnn.so.9" in done.stderr


def test_the_pixel_limit_is_64_megapixels(tmp_path: Path) -> None:
    """docs/models.md: relief takes images up to 64 megapixels. The limit was 64 Mi pixels
    (67,108,864): an 8100x8100 image (65.6 MP) went through."""
    over, at = tmp_path / "over.png", tmp_path / "at.png"
    Image.new("1", (8100, 8100)).save(over)  # one bit a pixel: small to make and to store
    Image.new("1", (8000, 8000)).save(at)
    with pytest.raises(relief_errors.BadInput, match="over the 64 megapixel limit"):
        picture.open_image(over)
    assert picture.open_image(at).size == (8000, 8000)


def test_a_warm_jobs_number_too_large_for_a_float_is_bad_input() -> None:
    """A JSON integer past a float's range (10**400) raised OverflowError in the warm runner: a
    model error, which ends the runner and retries the job, where a bad parameter is bad input."""
    with pytest.raises(modelkit.BadInput, match=r"params\.width_mm"):
        serve.job_params({"width_mm": 10**400})


def test_build_mesh_in_process_keeps_holes() -> None:
    # An opaque ring: the transparent middle must become a hole with its own walls (genus 1).
    pixels = np.zeros((40, 40, 4), dtype=np.uint8)
    pixels[..., :3] = 200
    pixels[4:36, 4:36, 3] = 255
    pixels[14:26, 14:26, 3] = 0
    params = relief.ReliefParams(width_mm=40.0, resolution=40, smoothing=0.0)
    result = relief.build_mesh(Image.fromarray(pixels, "RGBA"), params, relief.load("cpu"))
    assert_printable(result)
    assert result.euler_number == 0
    assert result.extents == pytest.approx([32.0, 32.0, 2.0])  # flat colour: a slab of base thickness


def test_params_given_as_plain_strings_act_as_their_enum(framed: Path) -> None:
    """ReliefParams(mask="none"), natural for a StrEnum, was kept as a str that is not MaskMode.NONE:
    the transparent border was cut away all the same."""
    params = relief.ReliefParams(resolution=32, mask="none")  # type: ignore[arg-type]
    assert params.mask is relief.MaskMode.NONE
    result = relief.build_mesh(picture.open_image(framed), params, relief.load("cpu"))
    assert result.extents[:2] == pytest.approx([100.0, 100.0])


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [("mask", "bogus", "mask must be one of auto, alpha, none"), ("invert", "false", "invert must be")],
)
def test_params_of_the_wrong_kind_are_refused(field: str, value: str, problem: str) -> None:
    """mask="bogus" was accepted (and meshed as if "alpha"); invert="false" inverted."""
    with pytest.raises(ValueError, match=problem):
        relief.ReliefParams(**{field: value})  # type: ignore[arg-type]


def test_any_mask_meshes_watertight() -> None:
    # Random masks are full of cells that touch only at a corner, which must not break the solid.
    rng = np.random.default_rng(7)
    cells = rng.random((24, 30)) < 0.5
    field = heightmap.Heightfield(rng.random((25, 31)).astype(np.float32), cells)
    result = mesh.build(field, cell_mm=1.0, base_mm=1.0, depth_mm=3.0)
    assert_printable(result)
    assert len(result.faces) >= 4 * int(cells.sum())


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    source = tmp_path / "rotated.png"
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, shown rotated 90 degrees clockwise
    Image.new("RGB", (40, 20), (1, 2, 3)).save(source, exif=exif)
    assert picture.open_image(source).size == (20, 40)


@pytest.mark.parametrize("mode", ["1", "L", "P", "LA", "PA", "RGB", "RGBA", "CMYK", "I;16", "I", "F"])
def test_image_modes_become_planes(mode: str) -> None:
    ramp = Image.linear_gradient("L").resize((32, 16)).convert(mode)
    planes = picture.to_planes(ramp, relief.MaskMode.AUTO, 16)
    assert planes.shape == (16, 32)
    assert np.isfinite(planes.luminance).all()
    assert planes.alpha is None  # opaque alpha bands are not a mask under auto


def test_torch_backend_matches_numpy() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, size=(90, 120, 4), dtype=np.uint8)
    pixels[:, :30, 3] = 0
    image = Image.fromarray(pixels, "RGBA")
    params = relief.ReliefParams(resolution=48, smoothing=1.5)
    planes = picture.to_planes(image, params.mask, params.resolution)
    grid = heightmap.plan_grid(image.size, params.resolution, params.width_mm)
    filters = heightmap.plan_filters(planes.shape, grid, params.smoothing)
    on_torch = torch_backend.TorchBackend(torch, "cpu")
    by_numpy = heightmap.heights(heightmap.surface(planes, filters, heightmap.NumpyBackend()), invert=False)
    by_torch = heightmap.heights(heightmap.surface(planes, filters, on_torch), invert=False)
    assert np.array_equal(by_torch.cells, by_numpy.cells)
    np.testing.assert_allclose(by_torch.heights, by_numpy.heights, atol=1e-4)


def exif_with_text_resolution(orientation: int) -> bytes:
    """An EXIF block with an orientation and XResolution written as text ("72"), as some editors
    write it: viewers read it, but Pillow cannot serialise it again (a RATIONAL tag holding a str)."""

    def entry(tag: int, kind: int, count: int, value: bytes) -> bytes:
        return struct.pack("<HHI", tag, kind, count) + value

    entries = [entry(0x0112, 3, 1, struct.pack("<HH", orientation, 0)), entry(0x011A, 2, 3, b"72\0\0")]
    ifd = struct.pack("<H", len(entries)) + b"".join(entries) + struct.pack("<I", 0)
    return b"Exif\0\0II*\0" + struct.pack("<I", 8) + ifd


@pytest.mark.parametrize("suffix", [".jpg", ".png"])
def test_a_photo_whose_exif_pillow_cannot_rewrite_is_still_turned_upright(
    tmp_path: Path, suffix: str
) -> None:
    """A 64x32 ramp (dark left) stored with orientation 6 and an XResolution tag stored as text
    crashed relief (exit 1, `TypeError: bad operand type for abs(): 'str'`; retried as a crash, and
    an error without bad_input in the warm runner): ImageOps.exif_transpose rewrites the EXIF after
    turning the picture, which relief does not need. The picture is fine: it must mesh, upright."""
    source = tmp_path / f"photo{suffix}"
    ramp = np.linspace(0, 255, 64, dtype=np.float64)[None, :].repeat(32, axis=0).astype(np.uint8)
    Image.fromarray(ramp, "L").save(source, exif=exif_with_text_resolution(6))
    assert picture.open_image(source).size == (32, 64)
    done = run_relief(source, tmp_path / "out", "--resolution", "32", "--width-mm", "60")
    assert done.returncode == 0, done.stderr
    result = load_mesh(tmp_path / "out/mesh.glb")
    assert_printable(result)
    assert result.extents[:2] == pytest.approx([30.0, 60.0])  # shown as a portrait
    top = result.vertices[result.vertices[:, 2] > 0]
    # The stored left (dark) edge is shown at the top of the picture: the largest y.
    assert top[top[:, 1] > 59.9, 2].max() == pytest.approx(2.0, abs=0.1)
    assert top[top[:, 1] < 0.1, 2].min() == pytest.approx(7.0, abs=0.1)


def test_an_upright_image_says_it_needs_no_more_turning(tmp_path: Path) -> None:
    """open_image's result no longer carries the orientation, so a caller's own exif_transpose
    (docs/models.md, "From Python") does not turn it a second time."""
    source = tmp_path / "rotated.jpg"
    Image.new("RGB", (40, 20), (1, 2, 3)).save(source, exif=exif_with_text_resolution(6))
    upright = picture.open_image(source)
    assert upright.size == (20, 40)
    assert ImageOps.exif_transpose(upright).size == (20, 40)


def test_an_image_faint_everywhere_is_refused_saying_what_the_mask_needs(tmp_path: Path) -> None:
    """An image 39 % opaque everywhere was refused as "transparent everywhere", which it is not:
    the answer names the cut-off it falls short of, and the way to mesh it anyway."""
    source = tmp_path / "faint.png"
    Image.new("RGBA", (32, 32), (90, 90, 90, 100)).save(source)
    done = run_relief(source, tmp_path / "out", "--resolution", "16")
    assert done.returncode == 65, done.stderr
    assert "no part of the image is at least 50% opaque (use --mask none" in done.stderr, done.stderr
    assert run_relief(source, tmp_path / "out", "--resolution", "16", "--mask", "none").returncode == 0
