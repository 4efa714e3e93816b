"""Byte counts as people read and write them, with one meaning everywhere.

Decimal units are powers of 1000 and binary units powers of 1024, as the SI and IEC
define them (and pydantic's ByteSize reads them): "2GB" is 2,000,000,000 bytes and
"2GiB" is 2,147,483,648. Every option that takes a size (--kv-memory, kv --memory,
prefix_cache_disk_bytes) goes through `parse_bytes`.
"""

from __future__ import annotations

import re

from macinfer.errors import MacinferError

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(?:([kmgt])(i)?)?b?\s*", re.I)


def parse_bytes(value: int | float | str, what: str = "a size") -> int:
    """'2GB' -> 2e9, '24GiB' -> 24 * 2**30, '512 MB', '1.5g', '2e9' or a plain number of bytes.

    Args:
        value: the size as given.
        what: what the size is, for the error message ("the KV memory budget").

    Raises:
        MacinferError: unreadable, or not positive.

    Example:
        >>> parse_bytes("1.5GB"), parse_bytes("2GiB")
        (1500000000, 2147483648)
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = int(value)
    else:
        m = _SIZE.fullmatch(str(value))
        if not m:
            raise MacinferError(f"cannot read '{value}' as {what}: write e.g. 2GB, 24GiB, 512MB or a byte count")
        number, prefix, binary = m.groups()
        power = "kmgt".index(prefix.lower()) + 1 if prefix else 0
        n = int(round(float(number) * (1024 if binary else 1000) ** power))
    if n <= 0:
        raise MacinferError(f"{what} must be positive, got {value}")
    return n


def fmt_bytes(n: float, binary: bool = False, digits: int | None = None) -> str:
    """115156224 -> '115.2 MB' (decimal), '109.8 MiB' with binary=True, '115 MB' with digits=3.

    Args:
        n: a byte count.
        binary: powers of 1024 (KiB, MiB, ...) instead of 1000.
        digits: significant figures instead of one decimal place.
    """
    base, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("B", "KB", "MB", "GB", "TB"))
    for unit in units:
        if abs(n) < base or unit == units[-1]:
            if unit == "B":
                return f"{n:.0f} B"
            if digits is not None:
                return f"{n:.0f} {unit}" if abs(n) >= 10 ** (digits - 1) else f"{n:.{digits}g} {unit}"
            return f"{n:.1f} {unit}"
        n /= base
    raise AssertionError("unreachable")


def fmt_size_change(before: float, after: float) -> str:
    """How a size changed, as a ratio above 1 either way: '3.20x smaller', '1.45x larger', 'same size'.

    Example:
        >>> fmt_size_change(98.3e6, 143.0e6), fmt_size_change(143.0e6, 98.3e6)
        ('1.45x larger', '1.45x smaller')
    """
    ratio = max(before, after) / max(min(before, after), 1)
    if f"{ratio:.2f}" == "1.00":
        return "same size"
    return f"{ratio:.2f}x {'smaller' if after < before else 'larger'}"
