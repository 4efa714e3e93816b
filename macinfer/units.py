"""Byte counts as people read and write them."""

from __future__ import annotations


def fmt_bytes(n: float, binary: bool = False) -> str:
    """115156224 -> '115.2 MB' (decimal), or '109.8 MiB' with binary=True."""
    base, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("B", "KB", "MB", "GB", "TB"))
    for unit in units:
        if n < base or unit == units[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= base
    raise AssertionError("unreachable")
