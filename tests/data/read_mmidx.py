#!/usr/bin/env python3
"""An independent reader of Megatron's MMIDIDX v1 indexed dataset, written from the layout
documented in src/tessera/data/indexed_dataset.h with the standard library only, so that the
tests check Tessera's files against the format rather than against Tessera's own reader.

usage: read_mmidx.py PREFIX
Prints {"dtype_code", "sequence_count", "document_count", "sequence_lengths",
"document_index", "sequences": [[token ids of each sequence]]} as JSON.
"""
import json
import struct
import sys

# Megatron's dtype codes -> struct format characters.
FORMATS = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 6: "d", 7: "f", 8: "H"}


def read(prefix):
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    if idx[:9] != b"MMIDIDX\x00\x00":
        raise SystemExit("bad magic")
    (version,) = struct.unpack_from("<Q", idx, 9)
    if version != 1:
        raise SystemExit("bad version %d" % version)
    code = idx[17]
    sequence_count, document_count = struct.unpack_from("<QQ", idx, 18)
    at = 34
    lengths = struct.unpack_from("<%di" % sequence_count, idx, at)
    at += 4 * sequence_count
    pointers = struct.unpack_from("<%dq" % sequence_count, idx, at)
    at += 8 * sequence_count
    document_index = struct.unpack_from("<%dq" % document_count, idx, at)
    at += 8 * document_count
    if at != len(idx):
        raise SystemExit("%d bytes after the document index" % (len(idx) - at))
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    fmt = FORMATS[code]
    sequences = [list(struct.unpack_from("<%d%s" % (n, fmt), data, p)) for n, p in zip(lengths, pointers)]
    if sequence_count and pointers[-1] + lengths[-1] * struct.calcsize(fmt) != len(data):
        raise SystemExit(".bin size does not match the index")
    return {
        "dtype_code": code,
        "sequence_count": sequence_count,
        "document_count": document_count,
        "sequence_lengths": list(lengths),
        "document_index": list(document_index),
        "sequences": sequences,
    }


if __name__ == "__main__":
    json.dump(read(sys.argv[1]), sys.stdout)
