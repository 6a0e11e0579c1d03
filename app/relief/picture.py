"""Reading an image file into the float planes the heightmap is computed from."""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import ExifTags, Image, ImageFile

from app.relief import errors, params

# Decoded pixels are held as several float planes; 64 megapixels keeps a job within a few GB of RAM.
MAX_PIXELS = 64_000_000
# The resampling filters see at least this many pixels per grid cell after the cheap pre-reduction.
OVERSAMPLE = 2

# Pillow plugins report damaged files with any of these, not only OSError.
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error)
# Modes whose values carry more than 8 bits; they go through float so no precision is lost.
_WIDE_MODES = frozenset({"I", "F", "I;16", "I;16L", "I;16B", "I;16N"})

FloatArray = npt.NDArray[np.float32]

# open_image marks a 16-bit colour PNG's image info with this when the PNG has a transparent colour.
KEY_16_BIT = "relief.16_bit_colour_key"

# How to turn a picture stored with each EXIF orientation upright (the table of ImageOps.exif_transpose).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


@dataclass(frozen=True, slots=True)
class Planes:
    """An image as float32 planes: luminance in any scale, alpha in 0..1 or None when unused."""

    luminance: FloatArray
    alpha: FloatArray | None

    @property
    def shape(self) -> tuple[int, int]:
        """Height and width in pixels."""
        height, width = self.luminance.shape
        return height, width


def open_image(path: Path) -> Image.Image:
    """Decode an image file completely and turn it upright per its EXIF orientation."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                width, height = img.size
                if width * height > MAX_PIXELS:
                    raise errors.BadInput(
                        f"{width}x{height} is over the {MAX_PIXELS / 1e6:.0f} megapixel limit"
                    )
                # Read before load(), which clears the tiles that tell the stored bit depth.
                key_16_bit = _has_16_bit_colour_key(img)
                img.load()
                upright = _upright(img)
    except (*_DECODE_ERRORS, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise errors.BadInput(f"cannot read image {path.name}: {exc}") from exc
    if key_16_bit:
        upright.info[KEY_16_BIT] = True
    return upright


def _upright(img: Image.Image) -> Image.Image:
    """A copy of a loaded image turned as its EXIF (or XMP) orientation says.

    Not ImageOps.exif_transpose: after turning, it rewrites the EXIF without the orientation, and
    that fails (TypeError, AttributeError) on tags some cameras and editors write with an unexpected
    type, on photos that viewers show fine. Nothing here needs the EXIF afterwards.
    """
    method = _UPRIGHT.get(img.getexif().get(ExifTags.Base.Orientation, 1))
    if method is None:
        return img.copy()  # a copy: the file's image is closed when open_image returns
    upright = img.transpose(method)
    # Only in memory, where getexif() keeps it: turning it again (exif_transpose) is a no-op.
    upright.getexif().pop(ExifTags.Base.Orientation, None)
    return upright


def _has_16_bit_colour_key(img: Image.Image) -> bool:
    """Whether an unloaded image is a 16-bit colour PNG with a transparent colour (tRNS)."""
    if img.format != "PNG" or not isinstance(img, ImageFile.ImageFile) or not img.tile:
        return False
    return img.tile[0][3] == "RGB;16B" and "transparency" in img.info


def to_planes(img: Image.Image, mask: params.MaskMode, resolution: int) -> Planes:
    """Extract luminance and (per the mask mode) alpha, box-reduced to about OVERSAMPLE px per cell."""
    try:
        alpha_img = _alpha(img, mask)
        lum_img = _luminance(img)
    except ValueError as exc:  # Pillow cannot convert a few exotic modes (e.g. "La")
        raise errors.BadInput(f"unsupported image mode {img.mode}: {exc}") from exc
    factor = max(img.size) // (OVERSAMPLE * resolution)
    if factor >= 2:
        # Pillow's C box filter is much cheaper than dense resampling matrices over every source pixel.
        lum_img = lum_img.reduce(factor)
        alpha_img = alpha_img.reduce(factor) if alpha_img is not None else None
    luminance = np.nan_to_num(np.asarray(lum_img, dtype=np.float32), posinf=0.0, neginf=0.0)
    # Heights are normalised later, so the scale is free: within +-1, a float image near +-3.4e38
    # cannot overflow float32 in the filters' sums.
    peak = float(np.abs(luminance).max(initial=0.0))
    if peak > 0.0:
        luminance /= peak
    alpha = None if alpha_img is None else np.asarray(alpha_img, dtype=np.float32) / 255.0
    return Planes(luminance, alpha)


def _luminance(img: Image.Image) -> Image.Image:
    """Grey levels as an "L" or "F" image; the scale does not matter, heights are normalised later."""
    if img.mode in _WIDE_MODES:
        return img.convert("F")
    if img.mode == "LAB":  # Pillow has no direct LAB -> L conversion
        return img.convert("RGB").convert("L")
    # Palette, CMYK, YCbCr, HSV, 1-bit and alpha modes all convert to ITU-R 601 luma directly.
    return img.convert("L")


def _alpha(img: Image.Image, mask: params.MaskMode) -> Image.Image | None:
    """The "L" alpha plane the mask should use, or None to keep every pixel."""
    if mask is params.MaskMode.NONE:
        return None
    # Covers alpha bands as well as palette or colour-key transparency (PNG tRNS, GIF).
    if not img.has_transparency_data:
        if mask is params.MaskMode.ALPHA:
            raise errors.BadInput("--mask alpha needs an image with an alpha channel")
        return None
    alpha = _alpha_band(img)
    if mask is params.MaskMode.AUTO and alpha.getextrema()[0] == 255:
        return None  # an alpha band that is opaque everywhere cuts nothing
    return alpha


def _alpha_band(img: Image.Image) -> Image.Image:
    """The "L" alpha band, or one made from the transparent colour (PNG tRNS); BadInput if it cannot be."""
    if "A" in img.getbands():
        return img.getchannel("A")
    key = img.info.get("transparency")
    if img.mode in _WIDE_MODES and isinstance(key, int | float):
        # Pillow's RGBA conversion drops a 16-bit grey key; the raw values are here to compare with it.
        return Image.fromarray(np.where(np.asarray(img) == key, 0, 255).astype(np.uint8))
    # Pillow reads 16-bit colour at 8 bits but keeps its key at 16, so no pixel would match.
    if img.info.get(KEY_16_BIT) or (isinstance(key, tuple) and max(key) > 255):
        raise errors.BadInput(
            "the transparent colour (tRNS) of a 16-bit colour PNG cannot be applied: "
            "save the image with an alpha channel, or use --mask none to keep every pixel"
        )
    return img.convert("RGBA").getchannel("A")
