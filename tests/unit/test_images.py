"""Image checks: the PNG check without decoding agrees with a full decode, and is stricter only on damage."""

from __future__ import annotations

import io
import random
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from app import errors, images

LIMIT = 10**8


def encode(image: Image.Image, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **options)
    return buffer.getvalue()


def noise(mode: str, size: tuple[int, int] = (37, 23), seed: int = 1) -> Image.Image:
    """Random pixels in `mode` (odd sizes, so sub-byte rows end mid-byte)."""
    rng = np.random.default_rng(seed)
    width, height = size
    if mode == "1":
        return Image.fromarray(rng.integers(0, 2, (height, width), dtype=np.uint8) * 255).convert("1")
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (height, width), dtype=np.uint16))
    if mode == "P":
        return Image.fromarray(rng.integers(0, 16, (height, width), dtype=np.uint8), "P")
    bands = len(Image.new(mode, (1, 1)).getbands())
    return Image.fromarray(rng.integers(0, 256, (height, width, bands), dtype=np.uint8).squeeze(), mode)


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    """(type, data) of each chunk."""
    found, pos = [], 8
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        found.append((png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]))
        pos += 12 + length
    return found


def assemble(parts: list[tuple[bytes, bytes]]) -> bytes:
    return images.PNG_SIGNATURE + b"".join(chunk(kind, data) for kind, data in parts)


def with_image_data(png: bytes, raw: bytes) -> bytes:
    """`png` with its image data replaced by `raw`, deflated into one IDAT (valid CRCs)."""
    parts = [(k, d) for k, d in chunks(png) if k != b"IDAT"]
    return assemble([*parts[:-1], (b"IDAT", zlib.compress(raw)), parts[-1]])


def refused(data: bytes) -> str:
    with pytest.raises(errors.InvalidRequest) as caught:
        images.inspect(data, max_pixels=LIMIT)
    return caught.value.message


@pytest.mark.parametrize("mode", ["1", "L", "LA", "RGB", "RGBA", "P", "I;16"])
@pytest.mark.parametrize("optimize", [False, True])
def test_whole_pngs_pass_without_decoding(mode, optimize):
    data = encode(noise(mode), optimize=optimize)
    assert images.check_png(data) is True
    checked = images.inspect(data, max_pixels=LIMIT)
    assert (checked.width, checked.height, checked.media_type) == (37, 23, "image/png")


def test_many_small_idat_chunks_and_one_huge_one():
    data = encode(noise("RGB", (300, 200)), compress_level=0)  # stored blocks, as in a noise photo
    raw = zlib.decompress(b"".join(d for k, d in chunks(data) if k == b"IDAT"))
    parts = [(k, d) for k, d in chunks(data) if k != b"IDAT"]
    stream = zlib.compress(raw, 0)
    split = [(b"IDAT", stream[i : i + 100]) for i in range(0, len(stream), 100)]
    assert images.check_png(assemble([*parts[:-1], *split, parts[-1]])) is True
    assert images.check_png(assemble([*parts[:-1], (b"IDAT", stream), parts[-1]])) is True


def test_a_bad_crc_is_refused():
    data = bytearray(encode(noise("RGB")))
    data[-20] ^= 0x01  # inside the last IDAT, before IEND
    assert "fails its CRC" in refused(bytes(data))


def test_image_data_cut_short_is_refused_even_with_iend_after_it():
    data = encode(noise("RGB"))
    parts = chunks(data)
    stream = b"".join(d for k, d in parts if k == b"IDAT")
    cut = [(k, d) for k, d in parts if k != b"IDAT"]
    forged = assemble([*cut[:-1], (b"IDAT", stream[: len(stream) // 2]), cut[-1]])
    assert "ends early" in refused(forged)
    # A complete zlib stream of too few rows is just as short.
    raw = zlib.decompress(stream)
    assert "ends early" in refused(with_image_data(data, raw[:-1]))


def test_too_much_image_data_or_a_bad_filter_byte_is_refused():
    data = encode(noise("L"))
    raw = bytearray(zlib.decompress(b"".join(d for k, d in chunks(data) if k == b"IDAT")))
    assert "more image data" in refused(with_image_data(data, bytes(raw) + b"\0"))
    row = 1 + 37
    raw[5 * row] = 9  # the filter byte of the sixth row
    assert "unknown filter type" in refused(with_image_data(data, bytes(raw)))


def test_damaged_deflate_data_is_refused():
    data = encode(noise("RGB"), compress_level=9)
    parts = chunks(data)
    stream = bytearray(b"".join(d for k, d in parts if k == b"IDAT"))
    stream[-3] ^= 0xFF  # the Adler-32 at the end of the stream
    rest = [(k, d) for k, d in parts if k != b"IDAT"]
    assert "damaged" in refused(assemble([*rest[:-1], (b"IDAT", bytes(stream)), rest[-1]]))


def interlaced(width: int, height: int) -> bytes:
    """A grey-scale Adam7-interlaced PNG (PIL does not write them)."""
    passes = (
        (0, 0, 8, 8),
        (4, 0, 8, 8),
        (0, 4, 4, 8),
        (2, 0, 4, 4),
        (0, 2, 2, 4),
        (1, 0, 2, 2),
        (0, 1, 1, 2),
    )
    raw = bytearray()
    for x0, y0, dx, dy in passes:
        for y in range(y0, height, dy):
            row = bytes((x * 7 + y * 3) % 256 for x in range(x0, width, dx))
            raw += b"\0" + row if row else b""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 1)
    return assemble([(b"IHDR", header), (b"IDAT", zlib.compress(bytes(raw))), (b"IEND", b"")])


def test_missing_iend_or_split_image_data_is_refused():
    data = encode(noise("RGB"))
    assert "before its IEND" in refused(data[:-12])
    parts = chunks(data)
    idat = next(d for k, d in parts if k == b"IDAT")
    split = [parts[0], (b"IDAT", idat[:50]), (b"tEXt", b"a\0b"), (b"IDAT", idat[50:]), parts[-1]]
    assert images.check_png(assemble(split)) is False  # left to the full decode, which refuses it
    assert "truncated or corrupt" in refused(assemble(split))


def test_unusual_layouts_go_to_the_full_decode():
    parts = chunks(encode(noise("RGB")))
    text_after = assemble([*parts[:-1], (b"tEXt", b"note\0after the image data"), parts[-1]])
    for data in (interlaced(37, 23), text_after):
        assert images.check_png(data) is False
        assert images.inspect(data, max_pixels=LIMIT).width == 37  # decoded fully, and whole
    whole = interlaced(37, 23)
    parts = chunks(whole)
    cut = assemble([parts[0], (b"IDAT", parts[1][1][:-20]), parts[-1]])
    assert "truncated or corrupt" in refused(cut)


def damaged(rng: random.Random, png: bytes) -> bytes:
    """`png` with random damage: to the file (CRCs catch it), or to its image data re-wrapped with
    valid CRCs (only the inflate, size and filter checks can catch it)."""
    parts = chunks(png)
    stream = bytearray(b"".join(d for k, d in parts if k == b"IDAT"))
    target = bytearray(png) if rng.random() < 0.3 else stream
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.2:
            del target[rng.randrange(len(target) // 2, len(target)) :]
        elif roll < 0.3:
            target += bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        else:
            target[rng.randrange(8, len(target))] = rng.randrange(256)
    if target is not stream:
        return bytes(target)
    rest = [(k, d) for k, d in parts if k != b"IDAT"]
    return assemble([*rest[:-1], (b"IDAT", bytes(stream)), rest[-1]])


def test_the_check_never_accepts_what_a_full_decode_refuses():
    """Random damage to real PNGs: whenever inspect accepts, PIL decodes every pixel."""
    rng = random.Random(7)
    sources = [
        encode(noise(mode, seed=s), compress_level=level)
        for mode in ("RGB", "L", "P", "RGBA", "1")
        for s, level in ((0, 0), (1, 6))
    ]
    accepted = 0
    for _ in range(600):
        data = damaged(rng, rng.choice(sources))
        try:
            images.inspect(data, max_pixels=LIMIT)
        except (errors.InvalidRequest, errors.UnsupportedMedia):
            continue
        accepted += 1
        with Image.open(io.BytesIO(data)) as decoded:
            decoded.load()
    assert 0 < accepted < 600  # damage to stored pixels passes (both agree), most else is caught


def test_read_upload_reads_once_and_caps():
    assert images.read_upload(io.BytesIO(b"x" * 10), 10) == b"x" * 10
    with pytest.raises(errors.PayloadTooLarge):
        images.read_upload(io.BytesIO(b"x" * 11), 10)


@pytest.mark.asyncio
async def test_a_small_plain_png_is_checked_on_the_loop_and_the_rest_in_a_thread(monkeypatch):
    """A hop to a thread costs more than checking a PNG of a megabyte or two; a full decode (JPEG,
    WebP, an unusual PNG), a large file or one that inflates to much more still goes to a thread,
    so the event loop never stalls."""
    import asyncio

    from app import intake

    hops: list[str] = []
    to_thread = asyncio.to_thread

    async def counted(func, /, *args, **kwargs):
        hops.append(func.__name__)
        return await to_thread(func, *args, **kwargs)

    monkeypatch.setattr(intake.asyncio, "to_thread", counted)
    limits = intake.Limits(64 << 20, LIMIT, queue_limit=10, priority_min=0, priority_max=10)
    jpeg = io.BytesIO()
    noise("RGB").save(jpeg, format="JPEG")
    big = encode(noise("RGB", (1200, 1200)), compress_level=0)  # over QUICK_CHECK_BYTES
    assert len(big) > intake.QUICK_CHECK_BYTES
    flat = encode(Image.new("RGB", (2000, 1500)))  # a few kB that inflate to 9 MB
    assert len(flat) < intake.QUICK_CHECK_BYTES < intake.QUICK_RAW_BYTES < 2000 * 1500 * 3
    cases = {
        "png": encode(noise("RGB")),
        "interlaced": interlaced(37, 23),
        "jpeg": jpeg.getvalue(),
        "big": big,
        "flat": flat,
    }
    seen = {}
    for name, data in cases.items():
        hops.clear()
        checked = await intake.check_image(io.BytesIO(data), limits)
        assert checked == images.inspect(data, max_pixels=LIMIT)  # the same answer either way
        seen[name] = list(hops)
    assert seen == {"png": [], **{name: ["inspect"] for name in ("interlaced", "jpeg", "big", "flat")}}
    with pytest.raises(errors.InvalidRequest, match="CRC"):  # refused on the loop, as in a thread
        await intake.check_image(io.BytesIO(cases["png"][:-5] + b"XXXXX"), limits)


def big_images() -> dict[str, bytes]:
    """Images of 90 to 182 megapixels, over Pillow's own "decompression bomb" limits (89.5 MP warns,
    179 MP fails) and within GPUJOBS_MAX_IMAGE_MEGAPIXELS=200 (settings allow up to 1000)."""
    side = 9500  # 90.25 MP
    jpeg = io.BytesIO()
    Image.new("L", (side, side), 128).save(jpeg, format="JPEG")
    width, height = 13_500, 13_500  # 182.25 MP, a plain PNG (checked without decoding it)
    squeeze = zlib.compressobj(9)
    rows = b"".join(squeeze.compress(b"\0" * (1 + width)) for _ in range(height)) + squeeze.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    png = images.PNG_SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")
    return {"jpeg": jpeg.getvalue(), "png": png}


def test_images_within_the_configured_limit_pass_however_large():
    """GPUJOBS_MAX_IMAGE_MEGAPIXELS above Pillow's limits was not honoured: a 90 MP JPEG was refused
    as "truncated or corrupt (... could be decompression bomb DOS attack)", a 182 MP PNG as "cannot
    be read". The configured limit is the one that counts, in both directions."""
    for kind, data in big_images().items():
        checked = images.inspect(data, max_pixels=200_000_000)
        assert checked.media_type == f"image/{kind}"
        with pytest.raises(errors.InvalidRequest, match="over the 50 megapixel limit"):
            images.inspect(data, max_pixels=50_000_000)


@pytest.mark.parametrize("cut", [16, 20, 24, 28])
def test_a_png_cut_off_inside_its_header_is_truncated_not_a_crash(cut):
    """png_rows unpacked the IHDR's five bytes from fewer: a ValueError, a 500 at POST /jobs."""
    data = encode(noise("RGB"))[:cut]
    assert images.png_rows(data) is None
    assert refused(data).startswith("image: the file is truncated or corrupt")


@pytest.mark.parametrize("kind", ["JPEG", "WEBP"])
def test_a_jpeg_or_webp_cut_off_inside_its_header_is_truncated(kind):
    """Pillow's error for a header it cannot finish was shown as "cannot be read (...)"."""
    buffer = io.BytesIO()
    noise("RGB").save(buffer, format=kind)
    for cut in (16, 24, 40):
        assert refused(buffer.getvalue()[:cut]).startswith("image: the file is truncated or corrupt")


def claiming(kind: str, width: int, height: int) -> bytes:
    """A small image whose header claims `width` x `height` (a decompression bomb's head)."""
    if kind == "PNG":
        ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
        return assemble([(b"IHDR", ihdr), (b"IDAT", zlib.compress(b"\0" * 1000)), (b"IEND", b"")])
    buffer = io.BytesIO()
    fmt, options = {
        "JPEG": ("JPEG", {}),
        "VP8 ": ("WEBP", {}),
        "VP8L": ("WEBP", {"lossless": True}),
        "VP8X": ("WEBP", {"exif": b"Exif\0\0II*\0\x08\0\0\0\0\0"}),
    }[kind]
    noise("RGB", (16, 16)).save(buffer, format=fmt, **options)
    data = bytearray(buffer.getvalue())
    if kind == "JPEG":
        at = data.index(b"\xff\xc0") + 5  # the frame header: length, precision, then height and width
        data[at : at + 4] = struct.pack(">HH", height, width)
    elif kind == "VP8 ":  # after the frame tag and start code
        data[26:30] = struct.pack("<HH", width, height)
    elif kind == "VP8L":  # after the signature byte, 14 bits each
        data[21:25] = ((width - 1) | (height - 1) << 14).to_bytes(4, "little")
    else:  # the canvas, 24 bits each
        assert data[12:16] == b"VP8X"
        data[24:30] = (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return bytes(data)


@pytest.mark.parametrize(
    ("kind", "side"),
    [(k, s) for k in ("PNG", "JPEG") for s in (9_000, 20_000, 60_000)]
    + [("VP8 ", 9_000), ("VP8 ", 16_000), ("VP8L", 9_000), ("VP8L", 16_000), ("VP8X", 60_000)],
)  # (a VP8X canvas under Pillow's limit is checked against its image by libwebp: this one fails)
def test_any_size_over_the_limit_is_named_with_the_limit(kind, side):
    """Over twice Pillow's own limit (179 MP), Pillow's DecompressionBombError text was shown
    ("exceeds limit of 178956970 pixels, could be decompression bomb DOS attack"), not ours."""
    with pytest.raises(errors.InvalidRequest) as caught:
        images.inspect(claiming(kind, side, side), max_pixels=64_000_000)
    megapixels = side * side / 1e6
    assert caught.value.message == (
        f"image: {side}x{side} is {megapixels:.1f} megapixels, over the 64 megapixel limit"
    )


def mpo(size: tuple[int, int] = (37, 23)) -> bytes:
    """A JPEG with an MPF extension and a second picture, as phones write them (Pillow: "MPO")."""
    buffer = io.BytesIO()
    extra = noise("RGB", size, seed=2)
    noise("RGB", size).save(buffer, format="MPO", save_all=True, append_images=[extra])
    return buffer.getvalue()


def test_a_phone_jpeg_with_an_mpf_extension_is_a_jpeg():
    """Pillow calls these MPO; they were refused 415 "MPO images are not accepted"."""
    data = mpo()
    with Image.open(io.BytesIO(data)) as opened:
        assert opened.format == "MPO"
    checked = images.inspect(data, max_pixels=LIMIT)
    assert (checked.width, checked.height, checked.media_type) == (37, 23, "image/jpeg")
    assert refused(data[: len(data) // 4]).startswith("image: the file is truncated or corrupt")


def test_a_small_jpeg_of_many_pixels_is_checked_without_holding_its_pixels(tmp_path):
    """A JPEG is checked by decoding it: at full size, a 1 MB JPEG of 8000x8000 (within the 64 MP
    limit) made the process hold 192 MB of pixels while it was checked, and a few such uploads at
    once about a gigabyte of the API's memory (which also runs the worker). Decoded at 1/8 scale,
    every coded byte is still read: a truncated file is refused all the same."""
    import subprocess
    import sys
    from pathlib import Path

    picture = io.BytesIO()
    Image.new("RGB", (8000, 8000), (1, 2, 3)).save(picture, format="JPEG", quality=5)
    data = picture.getvalue()
    (tmp_path / "big.jpg").write_bytes(data)
    # The peak of this process's memory (VmHWM), not ru_maxrss: that starts at the peak of the
    # process it was forked from (this one, which made the picture).
    probe = (
        "import re, sys; from pathlib import Path; from app import images\n"
        "peak = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', Path('/proc/self/status').read_text())[1])\n"
        "data = Path(sys.argv[1]).read_bytes()\n"
        "before = peak()\n"
        "images.inspect(data, max_pixels=64_000_000)\n"
        "print((peak() - before) // 1024)\n"
    )
    root = Path(__file__).resolve().parents[2]
    ran = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "big.jpg")], capture_output=True, text=True,
        timeout=60, cwd=root, check=True,
    )  # fmt: skip
    assert int(ran.stdout) < 32, f"checking a {len(data) / 1e6:.1f} MB JPEG took {ran.stdout.strip()} MB more"
    for cut in (0.5, 0.999):
        with pytest.raises(errors.InvalidRequest, match="truncated or corrupt"):
            images.inspect(data[: int(len(data) * cut)], max_pixels=64_000_000)
