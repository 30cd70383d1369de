#!/usr/bin/env python3
"""Write an IDX image dataset (e.g. Fashion-MNIST) as an ImageFolder tree of PNG files.

Usage: python3 tools/idx_to_imagefolder.py IMAGES.idx3[.gz] LABELS.idx1[.gz] OUT_DIR [--limit N]

OUT_DIR/<label>/<index>.png, grayscale PNGs written with the standard library alone (zlib): the
input tools/pack_images takes, for an end-to-end run of the packed data path on a real dataset.
"""
import gzip
import os
import struct
import sys
import zlib


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    dims = magic & 0xFF
    shape = struct.unpack(">" + "I" * dims, data[4:4 + 4 * dims])
    return shape, data[4 + 4 * dims:]


def png_gray(width, height, pixels):
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    raw = b"".join(b"\x00" + pixels[y * width:(y + 1) * width] for y in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def main():
    args = sys.argv[1:]
    limit = None
    if "--limit" in args:
        i = args.index("--limit")
        limit = int(args[i + 1])
        del args[i:i + 2]
    if len(args) != 3:
        sys.exit(__doc__.strip())
    (count, rows, cols), pixels = read_idx(args[0])
    (label_count,), labels = read_idx(args[1])
    if label_count != count:
        sys.exit(f"idx_to_imagefolder: {count} images but {label_count} labels")
    n = count if limit is None else min(count, limit)
    for i in range(n):
        d = os.path.join(args[2], str(labels[i]))
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{i:05d}.png"), "wb") as f:
            f.write(png_gray(cols, rows, pixels[i * rows * cols:(i + 1) * rows * cols]))
    print(f"idx_to_imagefolder: {n} images in {len(set(labels[:n]))} classes -> {args[2]}")


if __name__ == "__main__":
    main()
