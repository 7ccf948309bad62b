"""Writes flat Parquet files from rows with the standard library alone: the daemon's small, frequent files.

The daemon flushes a few hundred rows every 30 s. pyarrow's writer costs the process about 45 MiB
of resident memory (its shared libraries, a jemalloc arena, its Python modules) for that; this
module writes the same columns in ~300 lines of stdlib Python. Scope, on purpose narrow: one
row group, one PLAIN data page (v1) per column, every column OPTIONAL, and only the column types
the schemas in `schema.py` use: `timestamp[us, tz=UTC]`, `float64`, `int64`, `int32`, `string`,
`bool`. Pages are GZIP-compressed (zlib); the hourly compaction rewrites a partition with
pyarrow and ZSTD. Statistics: null counts for every column, min/max for the integer and
timestamp columns (what time filters prune on).

Values are checked as pyarrow would (a float in an integer column, an integer out of range, a
number in a string column raise), so a row that cannot be stored fails its batch before
anything is written, exactly like `schema.rows_to_table`. tests/test_flatparquet.py reads every
daemon schema back with pyarrow and DuckDB and compares with `rows_to_table`.

Format reference: apache/parquet-format `parquet.thrift` (Thrift compact protocol).
"""

from __future__ import annotations

import operator
import struct
import sys
import zlib
from array import array
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from .schema import BOOL, F64, I32, I64, STR, TS

MAGIC = b"PAR1"
CREATED_BY = "powerprof flatparquet"

# parquet.thrift enums
_BOOLEAN, _INT32, _INT64, _DOUBLE, _BYTE_ARRAY = 0, 1, 2, 5, 6
_OPTIONAL = 1
_UTF8, _TIMESTAMP_MICROS = 0, 10  # ConvertedType
_PLAIN, _RLE = 0, 3  # Encoding
_GZIP = 2  # CompressionCodec
_DATA_PAGE = 0

# Thrift compact protocol type ids
_T_TRUE, _T_FALSE, _T_I32, _T_I64, _T_BINARY, _T_LIST, _T_STRUCT = 1, 2, 5, 6, 8, 9, 12

_EPOCH, _US = datetime(1970, 1, 1, tzinfo=timezone.utc), timedelta(microseconds=1)
_I32_RANGE = (-(2**31), 2**31 - 1)
_I64_RANGE = (-(2**63), 2**63 - 1)
_PHYSICAL = {TS: _INT64, F64: _DOUBLE, I64: _INT64, I32: _INT32, STR: _BYTE_ARRAY, BOOL: _BOOLEAN}


# --- Thrift compact protocol ----------------------------------------------------------------------
# A struct is a list of (field_id, kind, value); kinds: i32, i64, bin, bool, struct, list_i32,
# list_bin, list_struct. Fields must be in increasing id order (the protocol writes deltas).


def _varint(n: int, out: bytearray) -> None:
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _zigzag(n: int) -> int:
    return (n << 1) ^ (n >> 63)


def _list_header(size: int, elem: int, out: bytearray) -> None:
    if size < 15:
        out.append((size << 4) | elem)
    else:
        out.append(0xF0 | elem)
        _varint(size, out)


def _struct(fields: list, out: bytearray) -> None:
    last = 0
    for fid, kind, value in fields:
        if value is None:
            continue
        t = {"i32": _T_I32, "i64": _T_I64, "bin": _T_BINARY, "struct": _T_STRUCT}.get(kind, _T_LIST)
        if kind == "bool":
            t = _T_TRUE if value else _T_FALSE
        delta = fid - last
        if 0 < delta <= 15:
            out.append((delta << 4) | t)
        else:
            out.append(t)
            _varint(_zigzag(fid), out)
        last = fid
        if kind in ("i32", "i64"):
            _varint(_zigzag(value), out)
        elif kind == "bin":
            b = value.encode() if isinstance(value, str) else value
            _varint(len(b), out)
            out += b
        elif kind == "struct":
            _struct(value, out)
        elif kind == "list_i32":
            _list_header(len(value), _T_I32, out)
            for v in value:
                _varint(_zigzag(v), out)
        elif kind == "list_bin":
            _list_header(len(value), _T_BINARY, out)
            for v in value:
                b = v.encode() if isinstance(v, str) else v
                _varint(len(b), out)
                out += b
        elif kind == "list_struct":
            _list_header(len(value), _T_STRUCT, out)
            for v in value:
                _struct(v, out)
    out.append(0)  # stop


def thrift(fields: list) -> bytes:
    out = bytearray()
    _struct(fields, out)
    return bytes(out)


# --- values -------------------------------------------------------------------------------------


def _int(v, lo_hi) -> int:
    if isinstance(v, float) or type(v).__name__ in ("float64", "float32"):
        # pyarrow takes 1.0 as 1 but also truncates 1.5 to 1: a whole float is an integer, any other is an error.
        if v != v or v in (float("inf"), float("-inf")) or v != int(v):
            raise ValueError(f"{v!r} is not a whole number")
        v = int(v)
    if isinstance(v, (bool, str, bytes)):
        raise TypeError(f"{v!r} is not an integer")
    i = operator.index(v)  # int, numpy integers; anything else raises TypeError
    if not lo_hi[0] <= i <= lo_hi[1]:
        raise OverflowError(f"integer {i} out of range for its column")
    return i


def _float(v) -> float:
    if isinstance(v, (str, bytes)):
        raise TypeError(f"{v!r} is not a number")
    if isinstance(v, int) and not -(2**53) <= v <= 2**53:
        raise ValueError(f"integer {v} would lose precision as a double")  # as pyarrow refuses it
    return float(v)  # int, float, bool, numpy scalars (as pyarrow); anything else raises TypeError


def _str(v) -> bytes:
    if isinstance(v, bytes):
        v.decode("utf-8")  # must be valid UTF-8, as pyarrow checks
        return v
    if not isinstance(v, str):
        raise TypeError(f"{v!r} is not a string")
    return v.encode("utf-8")


def _bool(v) -> bool:
    if isinstance(v, bool) or type(v).__name__ in ("bool", "bool_"):  # numpy's bool scalar: bool (2.x) or bool_
        return bool(v)
    raise TypeError(f"{v!r} is not a bool")


def _ts_us(v) -> int:
    """Integer ns since the epoch (as `rows_to_table` takes them) or a datetime (naive: UTC, as pyarrow) → µs."""
    if isinstance(v, float):
        raise TypeError(f"{v!r}: a timestamp is integer nanoseconds or a datetime")
    if isinstance(v, datetime):
        aware = v if v.tzinfo is not None else v.replace(tzinfo=timezone.utc)
        return _int((aware - _EPOCH) // _US, _I64_RANGE)
    return _int(v, _I64_RANGE) // 1000


_CONVERT = {
    TS: _ts_us,
    F64: _float,
    I64: lambda v: _int(v, _I64_RANGE),
    I32: lambda v: _int(v, _I32_RANGE),
    STR: _str,
    BOOL: _bool,
}


def _le(a: array) -> bytes:
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _plain(typ: str, vals: list) -> bytes:
    if typ in (TS, I64):
        return _le(array("q", vals))
    if typ == I32:
        return _le(array("i", vals))
    if typ == F64:
        return _le(array("d", vals))
    if typ == BOOL:
        out = bytearray((len(vals) + 7) // 8)
        for i, v in enumerate(vals):
            if v:
                out[i >> 3] |= 1 << (i & 7)
        return bytes(out)
    pack = struct.Struct("<I").pack
    return b"".join(pack(len(b)) + b for b in vals)


def _def_levels(present: list[bool]) -> bytes:
    """Definition levels (bit width 1) as RLE runs of the RLE/bit-packed hybrid, length-prefixed (data page v1)."""
    out = bytearray()
    i, n = 0, len(present)
    while i < n:
        j = i
        v = present[i]
        while j < n and present[j] == v:
            j += 1
        _varint((j - i) << 1, out)
        out.append(1 if v else 0)
        i = j
    return struct.pack("<I", len(out)) + bytes(out)


@dataclass(frozen=True)
class Column:
    """One column ready to write: its page (header and gzip body) and its statistics."""

    name: str
    typ: str
    n_values: int
    null_count: int
    body: bytes  # compressed definition levels + values
    raw_size: int  # uncompressed size of the same
    min_max: tuple[bytes, bytes] | None


@dataclass(frozen=True)
class FlatTable:
    """Rows converted and encoded for one file (what `write` takes): built before anything is written."""

    columns: list[Column]
    num_rows: int


def encode(columns: list[tuple[str, str]], rows: list[dict], fill: dict | None = None, level: int = 6) -> FlatTable:
    """Rows (dicts; a missing key is null, or its value in `fill`) → an encoded FlatTable of `columns`
    ((name, type) pairs from schema.py). Raises TypeError / OverflowError / ValueError for a value
    its column cannot hold, like `schema.rows_to_table`."""
    fill = fill or {}
    out = []
    for name, typ in columns:
        conv = _CONVERT[typ]
        default = fill.get(name)
        vals = [conv(v) for r in rows if (v := r.get(name, default)) is not None]
        present = [r.get(name, default) is not None for r in rows]
        raw = _def_levels(present) + _plain(typ, vals)
        min_max = None
        if vals and typ in (TS, I64, I32):
            fmt = "<i" if typ == I32 else "<q"
            min_max = (struct.pack(fmt, min(vals)), struct.pack(fmt, max(vals)))
        c = zlib.compressobj(level, zlib.DEFLATED, 31)  # wbits 31: the gzip format, which Parquet's GZIP codec is
        body = c.compress(raw) + c.flush()
        out.append(Column(name, typ, len(rows), len(rows) - len(vals), body, len(raw), min_max))
    return FlatTable(out, len(rows))


def _schema_element(name: str, typ: str) -> list:
    f = [(1, "i32", _PHYSICAL[typ]), (3, "i32", _OPTIONAL), (4, "bin", name)]
    if typ == STR:
        f += [(6, "i32", _UTF8), (10, "struct", [(1, "struct", [])])]  # LogicalType STRING
    elif typ == TS:
        unit = [(2, "struct", [])]  # TimeUnit MICROS
        f += [(6, "i32", _TIMESTAMP_MICROS), (10, "struct", [(8, "struct", [(1, "bool", True), (2, "struct", unit)])])]
    return f


def to_bytes(table: FlatTable) -> bytes:
    """The whole Parquet file."""
    buf = bytearray(MAGIC)
    chunks = []
    total_raw = total_comp = 0
    first_offset = len(buf)
    for c in table.columns:
        header = thrift([
            (1, "i32", _DATA_PAGE), (2, "i32", c.raw_size), (3, "i32", len(c.body)),
            (5, "struct", [(1, "i32", c.n_values), (2, "i32", _PLAIN), (3, "i32", _RLE), (4, "i32", _RLE)]),
        ])
        offset = len(buf)
        buf += header
        buf += c.body
        stats = [(3, "i64", c.null_count)]
        if c.min_max:
            stats += [(5, "bin", c.min_max[1]), (6, "bin", c.min_max[0])]
        raw, comp = len(header) + c.raw_size, len(header) + len(c.body)
        total_raw += raw
        total_comp += comp
        meta = [
            (1, "i32", _PHYSICAL[c.typ]), (2, "list_i32", [_PLAIN, _RLE]), (3, "list_bin", [c.name]), (4, "i32", _GZIP),
            (5, "i64", c.n_values), (6, "i64", raw), (7, "i64", comp), (9, "i64", offset), (12, "struct", stats),
        ]
        chunks.append([(2, "i64", offset), (3, "struct", meta)])
    root = [(4, "bin", "schema"), (5, "i32", len(table.columns))]
    schema = [root] + [_schema_element(c.name, c.typ) for c in table.columns]
    row_group = [(1, "list_struct", chunks), (2, "i64", total_raw), (3, "i64", table.num_rows),
                 (5, "i64", first_offset), (6, "i64", total_comp)]
    footer = thrift([
        (1, "i32", 2), (2, "list_struct", schema), (3, "i64", table.num_rows),
        (4, "list_struct", [row_group] if table.columns else []), (6, "bin", CREATED_BY),
        (7, "list_struct", [[(1, "struct", [])] for _ in table.columns]),  # ColumnOrder TYPE_ORDER: min/max are usable
    ])
    buf += footer
    buf += struct.pack("<I", len(footer)) + MAGIC
    return bytes(buf)
