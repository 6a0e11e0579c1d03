"""Uploaded images: read with a size cap, identify by content, reject bombs and broken files.

Every accepted image is whole: a file cut short or damaged is refused now, not in the model. For
JPEG, WebP and interlaced PNG that means decoding every pixel. A plain PNG (the common upload) is
checked as thoroughly without building the image, at a fraction of the cost: every chunk present
with a matching CRC up to IEND, the image data one complete zlib stream (its Adler-32 checked)
of exactly the size the header promises, and each row's filter byte valid. Anything unusual
about a PNG's layout sends it to the full decode instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import warnings
from typing import BinaryIO

from PIL import Image, UnidentifiedImageError
from zlib_ng import zlib_ng  # zlib's interface; its CRC-32 and inflate several times as fast

from app import errors
from app.queue import records

# PIL's format -> the media type stored. "MPO" is a JPEG with an MPF extension (phone cameras add
# one, with a second, smaller picture): any JPEG reader sees its first picture, which is what the
# full decode checks and what the model reads.
ACCEPTED = {"PNG": "image/png", "JPEG": "image/jpeg", "MPO": "image/jpeg", "WEBP": "image/webp"}
# How accepted files begin: one that begins so but cannot be identified is cut short, not foreign.
SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF")
PNG_SIGNATURE = SIGNATURES[0]
PNG_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
PNG_HEADER_END = 29  # the signature, then IHDR's length, type and 13 bytes of fields: all png_rows reads
PNG_FILTERS = bytes(range(5))  # the filter byte that starts each row: None, Sub, Up, Average, Paeth
# The image data is inflated in steps, so memory stays flat whatever the image's size:
# INFLATE_IN compressed bytes in (zlib copies what it has not read yet), INFLATE_OUT bytes out.
INFLATE_IN = 64 * 1024
INFLATE_OUT = 256 * 1024
# PIL identifies an image from its first bytes: it is shown this much first (a view of the upload
# would be copied whole into PIL's file object), and the whole file only if that was not enough.
IDENTIFY_BYTES = 64 * 1024
# The bytes of an upload: a view of the request's buffer, or bytes.
Data = bytes | memoryview


def read_upload(stream: BinaryIO, max_bytes: int) -> Data:
    """The upload's bytes, read in one go; PayloadTooLarge if there are more than `max_bytes`."""
    data = stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise errors.PayloadTooLarge(
            f"the image is larger than the {max_bytes / 1024 / 1024:g} MB limit; send a smaller file"
        )
    return data


def inspect(data: Data, *, max_pixels: int) -> records.NewInput:
    """Check the bytes are a whole PNG, JPEG or WebP image within the pixel limit."""
    checked = _inspect(data, max_pixels, decode=True)
    assert checked is not None
    return checked


def inspect_quickly(data: Data, *, max_pixels: int) -> records.NewInput | None:
    """inspect(), or None where that takes decoding every pixel (JPEG, WebP, an unusual PNG). The
    quick part costs about 1.2 ms per MB of PNG (SHA-256 most of it, then the inflate and CRC-32,
    in C); a full decode can take a hundred times that."""
    return _inspect(data, max_pixels, decode=False)


def _inspect(data: Data, max_pixels: int, *, decode: bool) -> records.NewInput | None:
    _allow_pixels(max_pixels)
    kind, width, height = _identify(data)
    if width * height > max_pixels:
        raise errors.InvalidRequest(
            f"image: {width}x{height} is {width * height / 1e6:.1f} megapixels, over the "
            f"{max_pixels / 1e6:g} megapixel limit",
            field="image",
        )
    if kind != "PNG" or not check_png(data):
        if not decode:
            return None
        _decode_fully(data, max_pixels)
    return records.NewInput(hashlib.sha256(data).hexdigest(), ACCEPTED[kind], width, height, data)


def _allow_pixels(max_pixels: int) -> None:
    """Let Pillow open images up to `max_pixels`. Its own guard against decompression bombs warns
    over Image.MAX_IMAGE_PIXELS (89.5 MP) and fails over twice that, whatever our limit: a 90 MP
    JPEG within GPUJOBS_MAX_IMAGE_MEGAPIXELS=100 was refused as corrupt. Ours is checked from the
    header before any pixel is decoded, so Pillow's may not be lower; it is only ever raised (one
    limit per process), never lowered, so concurrent checks need no lock."""
    if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < max_pixels:
        Image.MAX_IMAGE_PIXELS = max_pixels


def decoded_pixels(data: Data) -> int:
    """About how many pixels a full check of `data` holds in memory at once: a JPEG is decoded at
    1/8 of its size (`_decode_fully`), anything else whole. InvalidRequest or UnsupportedMedia for
    a file that is no image we take."""
    kind, width, height = _identify(data)
    return -(-width * height // 64) if kind in ("JPEG", "MPO") else width * height


def _identify(data: Data) -> tuple[str, int, int]:
    """(format, width, height) from the file's header; 415 for other kinds of file."""
    if not data:
        raise errors.InvalidRequest("image: the file is empty", field="image")
    if len(data) > IDENTIFY_BYTES:
        with contextlib.suppress(errors.InvalidRequest, errors.UnsupportedMedia):
            return _probe(data[:IDENTIFY_BYTES], bytes(data[:12]))
    return _probe(data, bytes(data[:12]))


def _probe(data: Data, head: bytes) -> tuple[str, int, int]:
    """What PIL makes of `data`, which begins with `head`."""
    try:
        kind, width, height = _read_header(data)
    except UnidentifiedImageError as exc:
        if _accepted_start(head):
            raise errors.InvalidRequest("image: the file is truncated or corrupt", field="image") from exc
        raise errors.UnsupportedMedia(
            "image: not a PNG, JPEG or WebP image (the type is read from the content, not the name)"
        ) from exc
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        if _accepted_start(head) and isinstance(exc, OSError | ValueError):  # cut off in its header
            raise _corrupt(str(exc)) from exc
        raise errors.InvalidRequest(f"image: cannot be read ({exc})", field="image") from exc
    if kind not in ACCEPTED:
        raise errors.UnsupportedMedia(f"image: {kind} images are not accepted; send PNG, JPEG or WebP")
    return kind, width, height


def _read_header(data: Data) -> tuple[str | None, int, int]:
    """(format, width, height) from the header, whatever the size. Image.open refuses a size over
    twice Image.MAX_IMAGE_PIXELS with its own text (decompression bomb...), which would hide the
    limit that counts, ours: such a header is read again without that check (nothing is decoded)."""
    try:
        with warnings.catch_warnings():  # the pixel limit is ours; PIL's warning is not needed
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as probe:
                return probe.format, probe.width, probe.height
    except Image.DecompressionBombError:
        if (found := _size_past_pillows_limit(data)) is None:
            raise
        return found


def _size_past_pillows_limit(data: Data) -> tuple[str | None, int, int] | None:
    """(format, width, height) of a PNG or JPEG from its PIL plugin, which skips Image.open's limit;
    of a WebP from its first chunk (its plugin checks the limit itself, before libwebp allocates)."""
    if data[8:12] == b"WEBP":
        size = _webp_size(bytes(data[12:30]))
        return None if size is None else ("WEBP", *size)
    for kind in ("PNG", "JPEG"):
        factory, accept = Image.OPEN[kind]
        if accept is not None and accept(bytes(data[:16])):
            with factory(io.BytesIO(data), "") as probe:
                return probe.format, probe.width, probe.height
    return None


def _webp_size(head: bytes) -> tuple[int, int] | None:
    """(width, height) from a WebP's first chunk: `head` is its type, length and first 10 bytes."""
    kind, little = head[:4], functools.partial(int.from_bytes, byteorder="little")
    if kind == b"VP8X":  # the canvas: width - 1 and height - 1, 24 bits each
        return 1 + little(head[12:15]), 1 + little(head[15:18])
    if kind == b"VP8L":  # after the signature byte: width - 1 and height - 1, 14 bits each
        bits = little(head[9:13])
        return 1 + (bits & 0x3FFF), 1 + (bits >> 14 & 0x3FFF)
    if kind == b"VP8 ":  # after the frame tag and start code: width and height, 14 bits each
        return little(head[14:16]) & 0x3FFF, little(head[16:18]) & 0x3FFF
    return None


def _accepted_start(head: bytes) -> bool:
    """Whether a file beginning with `head` begins as a PNG, JPEG or WebP does."""
    return head.startswith(SIGNATURES) and (not head.startswith(b"RIFF") or head[8:12] == b"WEBP")


def _corrupt(reason: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(
        f"image: the file is truncated or corrupt ({reason}); upload it again", field="image"
    )


def _decode_fully(data: Data, max_pixels: int) -> None:
    """Decode every pixel, so truncated or corrupt files are refused now, not in the model."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data)) as image:
                if image.width * image.height > max_pixels:
                    raise errors.InvalidRequest("image: too many pixels", field="image")
                if image.format in ("JPEG", "MPO"):
                    # At 1/8 of its size (the DCT's own scaling): every coded byte is still read,
                    # so a truncated or corrupt file fails the same, but a 1 MB JPEG of 64 MP no
                    # longer holds 192 MB of pixels while it is checked (a few such uploads at
                    # once took a gigabyte of the process that also runs the worker).
                    image.draft(image.mode, (max(1, image.width // 8), max(1, image.height // 8)))
                image.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning) as exc:
            raise _corrupt(str(exc)) from exc


def check_png(data: Data) -> bool:
    """Check a PNG is whole without decoding it (see the module doc): True if it is, InvalidRequest if
    it is not, False if its layout is unusual (interlaced, chunks after the image data...): decode it.
    """
    rows = png_rows(data)
    if rows is None:
        return False
    image_data = _png_image_data(data)
    if image_data is None:
        return False
    row, height = rows
    _inflate_rows(image_data, row=row, size=row * height)
    return True


def png_rows(data: Data) -> tuple[int, int] | None:
    """(bytes per row, rows) of a plain PNG's image data once inflated, from its header (a row is
    its filter byte, then its samples); None if not a PNG, of a layout check_png leaves alone, or cut
    off inside its header (PIL then calls it truncated)."""
    if data[8:16] != b"\0\0\0\x0dIHDR" or len(data) < PNG_HEADER_END:
        return None
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    depth, colour, compression, filtering, interlace = data[24:29]
    if colour not in PNG_SAMPLES or (compression, filtering, interlace) != (0, 0, 0):
        return None
    return 1 + (width * PNG_SAMPLES[colour] * depth + 7) // 8, height


def _png_image_data(data: Data) -> list[memoryview] | None:
    """The IDAT chunks' contents, once every chunk up to IEND is checked whole with its CRC; None when
    anything but IEND follows the image data (text, animation frames, a split: left to the full decode).
    """
    view, pos = memoryview(data), len(PNG_SIGNATURE)
    image_data: list[memoryview] = []
    while True:
        if pos + 12 > len(data):
            raise _corrupt("it ends before its IEND chunk")
        length, kind = int.from_bytes(data[pos : pos + 4], "big"), bytes(data[pos + 4 : pos + 8])
        end = pos + 8 + length
        if length > 0x7FFF_FFFF or end + 4 > len(data):
            raise _corrupt(f"its {kind.decode('latin-1')!r} chunk is cut short")
        if zlib_ng.crc32(view[pos + 4 : end]) != int.from_bytes(data[end : end + 4], "big"):
            raise _corrupt(f"its {kind.decode('latin-1')!r} chunk fails its CRC")
        if kind == b"IEND":
            if not image_data:
                raise _corrupt("it has no image data")
            return image_data
        if kind == b"IDAT":
            image_data.append(view[pos + 8 : end])
        elif image_data:
            return None
        pos = end + 4


def _inflate_rows(image_data: list[memoryview], *, row: int, size: int) -> None:
    """Inflate the image data in steps: one complete stream of `size` bytes, rows of `row` bytes."""
    inflater, done = zlib_ng.decompressobj(), 0
    try:
        for chunk in image_data:
            for start in range(0, len(chunk), INFLATE_IN):
                pending: bytes | memoryview = chunk[start : start + INFLATE_IN]
                while pending:
                    done = _check_rows(inflater.decompress(pending, INFLATE_OUT), done, row, size)
                    pending = inflater.unconsumed_tail
        done = _check_rows(inflater.flush(), done, row, size)
    except zlib_ng.error as exc:  # type: ignore[misc]  # its stub types `error` as an instance
        raise _corrupt(f"its image data is damaged: {exc}") from exc
    if not inflater.eof or done < size:
        raise _corrupt(f"its image data ends early, {done} of {size} bytes")


def _check_rows(out: bytes, done: int, row: int, size: int) -> int:
    """Check the filter bytes in `out`, the image data from offset `done` on; the new offset."""
    if done + len(out) > size:
        raise _corrupt(f"it has more image data than its {size} bytes")
    if out[-done % row :: row].translate(None, PNG_FILTERS):
        raise _corrupt("a row has an unknown filter type")
    return done + len(out)
