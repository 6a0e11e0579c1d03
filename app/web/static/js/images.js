// What the server checks of an upload, checked before sending it (app/images.py): size, type by
// content (PNG, JPEG, WebP), and the pixel count read from the header without decoding the image.

const HEAD_BYTES = 256 * 1024; // JPEG dimensions can come after large EXIF blocks

// Mirrors app/web/views.py size(): units of 1024, as the server words its upload limit.
export function formatSize(n) {
  for (const [unit, scale] of [['GB', 2 ** 30], ['MB', 2 ** 20], ['kB', 2 ** 10]]) {
    if (n >= scale) return `${Number((n / scale).toFixed(1))} ${unit}`;
  }
  return `${n} B`;
}

function kindOf(b) {
  if (b.length >= 8 && [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a].every((v, i) => b[i] === v)) return 'png';
  if (b.length >= 3 && b[0] === 0xff && b[1] === 0xd8 && b[2] === 0xff) return 'jpeg';
  const text = (from, to) => String.fromCharCode(...b.slice(from, to));
  if (b.length >= 12 && text(0, 4) === 'RIFF' && text(8, 12) === 'WEBP') return 'webp';
  return null;
}

function jpegSize(b) {
  let i = 2;
  while (i + 9 < b.length && b[i] === 0xff) {
    const marker = b[i + 1];
    const length = (b[i + 2] << 8) | b[i + 3];
    const isFrame = marker >= 0xc0 && marker <= 0xcf && ![0xc4, 0xc8, 0xcc].includes(marker);
    if (isFrame) return [(b[i + 7] << 8) | b[i + 8], (b[i + 5] << 8) | b[i + 6]];
    i += 2 + length;
  }
  return null;
}

function webpSize(b) {
  const chunk = String.fromCharCode(...b.slice(12, 16));
  const u24 = (at) => b[at] | (b[at + 1] << 8) | (b[at + 2] << 16);
  if (chunk === 'VP8X') return [1 + u24(24), 1 + u24(27)];
  if (chunk === 'VP8L') {
    return [1 + (((b[22] & 0x3f) << 8) | b[21]), 1 + (((b[24] & 0x0f) << 10) | (b[23] << 2) | ((b[22] & 0xc0) >> 6))];
  }
  if (chunk === 'VP8 ') return [(b[26] | (b[27] << 8)) & 0x3fff, (b[28] | (b[29] << 8)) & 0x3fff];
  return null;
}

function sizeOf(kind, b) {
  if (kind === 'png') return b.length >= 24 ? [new DataView(b.buffer).getUint32(16), new DataView(b.buffer).getUint32(20)] : null;
  return kind === 'jpeg' ? jpegSize(b) : webpSize(b);
}

// The problem with `file` as the server would word it ("image: ..."), or null if it may be sent.
export async function checkImage(file, { maxBytes, maxPixels }) {
  if (file.size === 0) return 'image: the file is empty';
  if (file.size > maxBytes) {
    return `image: the file is ${formatSize(file.size)}, larger than the ${formatSize(maxBytes)} limit; send a smaller file`;
  }
  const head = new Uint8Array(await file.slice(0, HEAD_BYTES).arrayBuffer());
  const kind = kindOf(head);
  if (!kind) return 'image: not a PNG, JPEG or WebP image (the type is read from the content, not the name)';
  const size = sizeOf(kind, head);
  if (size && size[0] * size[1] > maxPixels) {
    const [w, h] = size;
    return `image: ${w}x${h} is ${((w * h) / 1e6).toFixed(1)} megapixels, over the ${maxPixels / 1e6} megapixel limit`;
  }
  return null;
}
