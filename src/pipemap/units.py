"""Memory sizes: parse ``"24GiB"``/``"500MB"``/``1024`` to bytes, print bytes back for people, and round a tensor's
bytes up to where the next one starts in a packed buffer."""

from __future__ import annotations

import re
from decimal import Decimal

from .errors import MemorySpecError, format_bytes  # format_bytes lives below, for error messages

_UNITS = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)  # ASCII: "２GiB" is no size


def parse_bytes(value: int | str) -> int:
    """Bytes from an integer or a string: ``parse_bytes("1.5GiB") == 1610612736``; KB/MB/GB are powers of 1000."""
    if isinstance(value, bool):
        raise MemorySpecError(value)
    if isinstance(value, int):
        if value < 0:
            raise MemorySpecError(value)
        return value
    if not isinstance(value, str):
        raise MemorySpecError(value)
    match = _SIZE.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise MemorySpecError(value)
    # Decimal, not float: float("2.01") * 1000 is 2009.999..., which int() would truncate to 2009.
    return int(Decimal(match.group(1)) * _UNITS[match.group(2).lower()])


_DECIMAL = {"kb": (3, "KiB", 10), "mb": (6, "MiB", 20), "gb": (9, "GiB", 30), "tb": (12, "TiB", 40)}


def decimal_note(text: str) -> str | None:
    """How a size written in KB/MB/GB/TB was read (powers of 1000, as parse_bytes reads them) and how to write the
    binary size instead; None for any other spelling. ``2x16GB`` is two GPUs of 14.90 GiB, not 16:

    >>> decimal_note("16GB")
    "read '16GB' as 16 x 10^9 bytes = 14.90 GiB (GB: powers of 1000); write 16GiB for 16 x 2^30 bytes"
    """
    match = _SIZE.match(text) if isinstance(text, str) else None
    if match is None or match.group(2).lower() not in _DECIMAL:
        return None
    number, unit = match.group(1), match.group(2).lower()
    power, binary, bits = _DECIMAL[unit]
    return (f"read {text.strip()!r} as {number} x 10^{power} bytes = {format_bytes(parse_bytes(text))} "
            f"({unit.upper()}: powers of 1000); write {number}{binary} for {number} x 2^{bits} bytes")


ALIGN = 16  # bytes each tensor starts at in a packed buffer: what vectorised kernels and cuBLAS need


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN``: what one tensor takes in a packed buffer."""
    return -(-nbytes // ALIGN) * ALIGN


__all__ = ["ALIGN", "aligned", "decimal_note", "format_bytes", "parse_bytes"]
