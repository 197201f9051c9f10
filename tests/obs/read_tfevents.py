#!/usr/bin/env python3
"""An independent reader of TensorBoard event files, for checking Tessera's writer: it shares
no code with it (its own bitwise CRC-32C, its own protocol buffer decoder) and is strict, so
that anything the writer gets wrong fails here rather than being skipped by TensorBoard.

The layout, from TensorFlow's record_writer.cc and event.proto / summary.proto:
  record:  uint64 length, uint32 masked_crc(length), data, uint32 masked_crc(data), little-endian;
           masked_crc(x) = ((crc >> 15) | (crc << 17)) + 0xa282ead8, crc = CRC-32C(x)
  Event:   wall_time = 1 (double), step = 2 (int64), file_version = 3 (string), summary = 5
  Summary: value = 1 (repeated Value);  Value: tag = 1 (string), simple_value = 2 (float)

Usage: read_tfevents.py FILE
Prints {"events": [{"wall_time", "step", "file_version" | "scalars": [[tag, value], ...]}]} as
JSON; exits 1 with the reason (a CRC mismatch, a truncated record, an unexpected field) on
stderr.
"""
import json
import struct
import sys


class BadFile(Exception):
    pass


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data):
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_varint(buf, pos):
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise BadFile("varint runs past the end of its message")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos
        if shift > 63:
            raise BadFile("varint longer than 10 bytes")


def fields(buf):
    """(field number, wire type, value) of each field of a message: an int for varints, the
    raw bytes otherwise."""
    pos = 0
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = read_varint(buf, pos)
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            value, pos = buf[pos:pos + size], pos + size
            if len(value) != size:
                raise BadFile("fixed-size field runs past the end of its message")
        elif wire_type == 2:
            size, pos = read_varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
            if len(value) != size:
                raise BadFile("length-delimited field runs past the end of its message")
        else:
            raise BadFile(f"field {number} has wire type {wire_type}")
        yield number, wire_type, value


def decode_value(buf):
    tag, value = None, None
    for number, wire_type, v in fields(buf):
        if (number, wire_type) == (1, 2):
            tag = v.decode("utf-8")
        elif (number, wire_type) == (2, 5):
            value = struct.unpack("<f", v)[0]
        else:
            raise BadFile(f"Summary.Value field {number} (wire type {wire_type}) is not a scalar's")
    if tag is None or value is None:
        raise BadFile("Summary.Value without tag or simple_value")
    return [tag, value]


def decode_summary(buf):
    scalars = []
    for number, wire_type, v in fields(buf):
        if (number, wire_type) != (1, 2):
            raise BadFile(f"Summary field {number} (wire type {wire_type}) is unexpected")
        scalars.append(decode_value(v))
    return scalars


def decode_event(buf):
    event = {"step": 0}
    for number, wire_type, v in fields(buf):
        if (number, wire_type) == (1, 1):
            event["wall_time"] = struct.unpack("<d", v)[0]
        elif (number, wire_type) == (2, 0):
            event["step"] = v - (1 << 64) if v >> 63 else v
        elif (number, wire_type) == (3, 2):
            event["file_version"] = v.decode("utf-8")
        elif (number, wire_type) == (5, 2):
            event["scalars"] = decode_summary(v)
        else:
            raise BadFile(f"Event field {number} (wire type {wire_type}) is unexpected")
    if "wall_time" not in event:
        raise BadFile("Event without wall_time")
    return event


def read_records(data):
    pos, index = 0, 0
    while pos < len(data):
        header = data[pos:pos + 12]
        if len(header) < 12:
            raise BadFile(f"record {index}: truncated header")
        length_bytes = header[:8]
        (length,) = struct.unpack("<Q", length_bytes)
        (length_crc,) = struct.unpack("<I", header[8:])
        if masked_crc32c(length_bytes) != length_crc:
            raise BadFile(f"record {index}: length CRC mismatch")
        body = data[pos + 12:pos + 12 + length]
        footer = data[pos + 12 + length:pos + 16 + length]
        if len(body) != length or len(footer) != 4:
            raise BadFile(f"record {index}: truncated data")
        if masked_crc32c(body) != struct.unpack("<I", footer)[0]:
            raise BadFile(f"record {index}: data CRC mismatch")
        yield body
        pos += 16 + length
        index += 1


def main():
    with open(sys.argv[1], "rb") as f:
        data = f.read()
    try:
        events = [decode_event(record) for record in read_records(data)]
    except BadFile as e:
        print(f"{sys.argv[1]}: {e}", file=sys.stderr)
        sys.exit(1)
    json.dump({"events": events}, sys.stdout)


if __name__ == "__main__":
    main()
