"""What the code :mod:`pipeline.codec.binary` generates calls at run time: varints and the
error of a malformed encoding.

Every long and int of every compiled schema is read by :func:`read_raw_varint` (beyond its
first byte), so the rule that a varint holds at most 64 bits is kept here, in one place.
"""

from __future__ import annotations

from typing import Final

LONG_MIN: Final = -(2**63)
LONG_MAX: Final = 2**63 - 1
INT_MIN: Final = -(2**31)
INT_MAX: Final = 2**31 - 1
# The value of every one-byte varint: one lookup instead of the zigzag arithmetic.
ZIGZAG: Final = tuple((b >> 1) ^ -(b & 1) for b in range(128))


class Malformed(Exception):
    """Raised by generated code for a structural error; carries the message."""


def write_long(buf: bytearray, n: int) -> None:
    """Append ``n`` as an Avro long (zigzag varint); a wider integer is Malformed."""
    if not LONG_MIN <= n <= LONG_MAX:
        raise Malformed(f"integer {n} does not fit an Avro long")
    z = (n << 1) ^ (n >> 63)
    while z > 0x7F:
        buf.append((z & 0x7F) | 0x80)
        z >>= 7
    buf.append(z)


def write_int(buf: bytearray, n: int) -> None:
    """Append ``n`` as an Avro int: a long that a 32-bit reader can take."""
    if not INT_MIN <= n <= INT_MAX:
        raise Malformed(f"integer {n} does not fit an Avro int")
    write_long(buf, n)


def fail(message: str) -> int:
    raise Malformed(message)


def not_an_int(n: int, where: str) -> None:
    raise Malformed(f"{where}: {n} does not fit an Avro int (32 bits)")


def read_raw_varint(data: bytes, pos: int, where: str) -> tuple[int, int]:
    """The varint at ``pos`` as written (still zigzag-encoded) and the position after it.
    Unrolled up to 6 bytes, the size of every event's millisecond timestamp. ``where``
    (the field being read) only names the field when the varint is refused."""
    b = data[pos]
    z = b & 0x7F
    if b < 0x80:
        return z, pos + 1
    b = data[pos + 1]
    z |= (b & 0x7F) << 7
    if b < 0x80:
        return z, pos + 2
    b = data[pos + 2]
    z |= (b & 0x7F) << 14
    if b < 0x80:
        return z, pos + 3
    b = data[pos + 3]
    z |= (b & 0x7F) << 21
    if b < 0x80:
        return z, pos + 4
    b = data[pos + 4]  # the rest in a second small integer: cheaper than growing z
    high = b & 0x7F
    if b < 0x80:
        return z | high << 28, pos + 5
    b = data[pos + 5]
    high |= (b & 0x7F) << 7
    if b < 0x80:
        return z | high << 28, pos + 6
    return _read_varint_tail(data, pos + 6, z | high << 28, 42, where)


def _read_varint_tail(data: bytes, pos: int, z: int, shift: int, where: str) -> tuple[int, int]:
    """The rest of a varint of 7 bytes or more. An Avro long is 64 bits: no writer writes
    more than 10 bytes, nor a 10th byte above 1 (bits 64 and up). Python's integers would
    take either without complaint, and an event holding such a value could never be written
    back, so both are refused here, where every long and int of every schema is read."""
    while True:
        b = data[pos]
        pos += 1
        z |= (b & 0x7F) << shift
        if b < 0x80:
            if z >> 64:
                raise Malformed(f"{where}: varint of {z.bit_length()} bits, more than the "
                                f"64 of an Avro long")
            return z, pos
        shift += 7
        if shift > 63:
            raise Malformed(f"{where}: varint longer than 10 bytes (an Avro long has 64 bits)")
