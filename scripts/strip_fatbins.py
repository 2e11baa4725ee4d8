"""Zeroes the GPU code of every architecture but one in a CUDA shared library (libtorch_cuda.so),
so that it compresses to what a size-limited transfer can carry. The file keeps its size and
layout: each fatbin's headers stay, the other architectures' payloads become zeros, and a GPU of
the kept architecture loads its own images as before (a GPU of another one would fail).

Used by scripts/gpu_stage.sh to carry libtorch 2.13 to a lent H100/H200 (sm_90): 310 MB of
kernels become 53 MB. Fatbins without an image of the kept architecture are left whole.

usage: strip_fatbins.py IN OUT [--arch 90]
"""

import argparse
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
ELF_IMAGE = 2


def section(data: bytes, name: str) -> tuple[int, int]:
    """(offset, size) of the ELF64 section `name`."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    for name_off, _type, _flags, _addr, offset, size in headers:
        end = data.index(b"\0", names_at + name_off)
        if data[names_at + name_off:end].decode() == name:
            return offset, size
    sys.exit(f"no {name} section: not a CUDA library")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--arch", type=int, default=90, help="the SM architecture kept (90: Hopper)")
    a = p.parse_args()
    data = bytearray(open(a.input, "rb").read())
    base, size = section(data, ".nv_fatbin")
    pos, kept, zeroed, whole = base, 0, 0, 0
    while pos < base + size:
        if struct.unpack_from("<I", data, pos)[0] != FATBIN_MAGIC:
            pos += 8  # fatbins are 8-byte aligned
            continue
        _magic, _version, header, fat_size = struct.unpack_from("<IHHQ", data, pos)
        images, at = [], pos + header
        while at < pos + header + fat_size:
            kind, _, image_header, payload = struct.unpack_from("<HHIQ", data, at)
            arch, = struct.unpack_from("<I", data, at + 28)
            images.append((kind, arch, at + image_header, payload))
            at += image_header + payload
        if any(kind == ELF_IMAGE and arch == a.arch for kind, arch, _, _ in images):
            for kind, arch, start, payload in images:
                if kind == ELF_IMAGE and arch == a.arch:
                    kept += payload
                else:
                    data[start:start + payload] = bytes(payload)
                    zeroed += payload
        else:
            whole += fat_size
        pos += header + fat_size
    open(a.output, "wb").write(data)
    print(f"kept {kept} bytes of sm_{a.arch} images, zeroed {zeroed}, left {whole} in fatbins "
          f"without sm_{a.arch}")


if __name__ == "__main__":
    main()
