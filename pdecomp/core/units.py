"""Byte sizes as people read them."""

GiB = 2**30
MiB = 2**20


def fmt_bytes(b: float) -> str:
    return f"{b / GiB:.3f} GiB" if abs(b) >= GiB else f"{b / MiB:.3f} MiB"
