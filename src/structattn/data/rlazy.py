"""Read one object from an R package's lazy-load data (``data/Rdata.rdx`` + ``Rdata.rdb``).

An installed R package keeps its datasets in a lazy-load database: ``Rdata.rdx`` is a
compressed serialized list naming each object's ``(offset, length)`` in ``Rdata.rdb``, and each
piece of the ``.rdb`` is a 4-byte big-endian uncompressed length, then (for R's compression
types 2 and 3) one byte naming the compression (``Z`` xz/LZMA2 raw stream, ``2`` bzip2, ``1``
zlib, ``0`` none), then the compressed serialization. Only the serialization format is parsed
(by the ``rdata`` package, which builds Python values and runs no R code): a damaged file is a
:class:`ValueError`, never code run.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import warnings
import zlib
from pathlib import Path
from typing import Any

__all__ = ["read_lazyload", "lazyload_names"]

_LZMA2 = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]  # R's xz settings


def _parse(raw: bytes) -> Any:
    import rdata

    with warnings.catch_warnings():  # "assumed RDS", "tbl_df read as data.frame": expected here
        warnings.simplefilter("ignore", UserWarning)
        try:
            return rdata.conversion.convert(rdata.parser.parse_data(raw))
        except Exception as err:  # the parser raises many kinds on a damaged stream
            raise ValueError(f"not an R serialization ({type(err).__name__}: {err})") from None


def _index(base: Path) -> dict[str, Any]:
    rdx = Path(f"{base}.rdx").read_bytes()
    try:
        raw = gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else zlib.decompress(rdx[4:])
    except (OSError, zlib.error, EOFError) as err:
        raise ValueError(f"{base}.rdx: not a compressed R index ({err})") from None
    index = _parse(raw)
    if not isinstance(index, dict) or "variables" not in index:
        raise ValueError(f"{base}.rdx: no 'variables' table in this index")
    return index["variables"]


def lazyload_names(base: str | Path) -> list[str]:
    """The objects of the database ``base`` (the path without ``.rdx`` / ``.rdb``)."""
    return [str(k) for k in _index(Path(base))]


def _decompress(piece: bytes) -> bytes:
    if len(piece) < 5:
        raise ValueError("a piece shorter than its header")
    (length,) = struct.unpack(">I", piece[:4])
    kind, body = piece[4:5], piece[5:]
    try:
        if kind == b"Z":
            out = lzma.decompress(body, format=lzma.FORMAT_RAW, filters=_LZMA2)
        elif kind == b"2":
            out = bz2.decompress(body)
        elif kind == b"1":
            out = zlib.decompress(body)
        elif kind == b"0":
            out = body
        else:  # R's first compression type: zlib right after the length
            out = zlib.decompress(piece[4:])
    except (lzma.LZMAError, OSError, zlib.error, EOFError) as err:
        raise ValueError(f"a piece does not decompress ({err})") from None
    if len(out) != length:
        raise ValueError(f"a piece decompresses to {len(out)} bytes, its header says {length}")
    return out


def read_lazyload(base: str | Path, name: str) -> Any:
    """The object ``name`` of the lazy-load database ``base`` as Python values (a data frame
    becomes a ``pandas.DataFrame``)."""
    base = Path(base)
    index = _index(base)
    if name not in index:
        raise KeyError(f"{base}: no object {name!r}; it holds {sorted(map(str, index))}")
    offset, size = (int(x) for x in index[name])
    with open(f"{base}.rdb", "rb") as f:
        f.seek(offset)
        piece = f.read(size)
    if len(piece) != size:
        raise ValueError(f"{base}.rdb is shorter than its index says ({name!r} is cut)")
    return _parse(_decompress(piece))
