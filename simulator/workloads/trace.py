"""Mooncake-format traces: one request per JSON object.

| field           | meaning                                                        |
| --------------- | -------------------------------------------------------------- |
| ``timestamp``   | arrival, milliseconds from the start of the trace (int/float)  |
| ``input_length``| prompt tokens                                                  |
| ``output_length``| generated tokens                                              |
| ``hash_ids``    | prefix block ids, one per ``block_tokens`` (512) token block   |

Accepted files: JSON lines (``.jsonl``, blank lines skipped), a JSON array (``.json`` or any
file whose first non-blank byte is ``[``), either optionally gzip-compressed (``.gz``).
Unknown extra fields are ignored, so traces that carry more (session ids ...) still load.

Lines are validated with msgspec; a bad line raises :class:`TraceFormatError` naming the
file, the line (or array element) and the field.
"""

from __future__ import annotations

import gzip
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, BinaryIO, Iterable, Iterator, Union

import msgspec

_NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
_NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class TraceRow(msgspec.Struct, frozen=True):
    """One trace request. ``timestamp`` is in milliseconds."""

    timestamp: Union[_NonNegInt, _NonNegFloat]
    input_length: _NonNegInt
    output_length: _NonNegInt
    hash_ids: list[_NonNegInt]

    @property
    def arrival_s(self) -> float:
        return self.timestamp / 1000.0

    def to_dict(self) -> dict:
        return {"timestamp": self.timestamp, "input_length": self.input_length,
                "output_length": self.output_length, "hash_ids": list(self.hash_ids)}


@dataclass(frozen=True)
class TraceIssue:
    """Where a trace is malformed. ``line`` is 1-based; for JSON arrays it is the element number."""

    line: int
    field: str | None
    message: str

    def __str__(self) -> str:
        where = f"line {self.line}"
        if self.field:
            where += f", field '{self.field}'"
        return f"{where}: {self.message}"


class TraceFormatError(ValueError):
    """A trace file that does not follow the format; lists every issue found (up to a cap)."""

    def __init__(self, source: str, issues: list[TraceIssue], *, truncated: bool = False):
        self.source = source
        self.issues = issues
        self.truncated = truncated
        lines = [f"{source}: {len(issues)}{'+' if truncated else ''} malformed trace record(s)"]
        lines += [f"  {i}" for i in issues]
        if truncated:
            lines.append("  ... (more not shown)")
        super().__init__("\n".join(lines))

    @property
    def lines(self) -> list[int]:
        return [i.line for i in self.issues]


_ROW_DECODER = msgspec.json.Decoder(TraceRow)
_ARRAY_DECODER = msgspec.json.Decoder(list[msgspec.Raw])
_PATH_RE = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING_RE = re.compile(r"missing required field `(?P<field>[^`]+)`")


def _issue(line: int, exc: Exception) -> TraceIssue:
    msg = str(exc)
    field = None
    m = _PATH_RE.search(msg)
    if m:
        field = m.group("path").lstrip(".") or None
        msg = msg[: m.start()]
    else:
        m = _MISSING_RE.search(msg)
        if m:
            field = m.group("field")
    if not isinstance(exc, msgspec.ValidationError):  # ValidationError subclasses DecodeError
        msg = f"not valid JSON ({msg})"
    return TraceIssue(line=line, field=field, message=msg)


def _check_blocks(row: TraceRow, block_tokens: int | None) -> str | None:
    if block_tokens is None:
        return None
    want = math.ceil(row.input_length / block_tokens)
    if len(row.hash_ids) != want:
        return (f"{len(row.hash_ids)} hash_ids for input_length {row.input_length} "
                f"(expected {want} blocks of {block_tokens} tokens)")
    return None


def _open(path: Path) -> BinaryIO:
    if path.suffix == ".gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return path.open("rb")


def _first_byte(fh: BinaryIO) -> bytes:
    while True:
        chunk = fh.read(1)
        if not chunk or not chunk.isspace():
            return chunk


def _decode_one(line_no: int, data: bytes | memoryview, block_tokens: int | None) -> TraceRow | TraceIssue:
    try:
        row = _ROW_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return _issue(line_no, exc)
    problem = _check_blocks(row, block_tokens)
    if problem:
        return TraceIssue(line=line_no, field="hash_ids", message=problem)
    return row


def _records(path: Path, block_tokens: int | None) -> Iterator[TraceRow | TraceIssue]:
    with _open(path) as fh:
        is_array = _first_byte(fh) == b"["
        fh.seek(0)
        if is_array:
            try:
                elements = _ARRAY_DECODER.decode(fh.read())
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                yield TraceIssue(line=1, field=None, message=f"not a JSON array of objects ({exc})")
                return
            for n, raw in enumerate(elements, start=1):
                yield _decode_one(n, raw, block_tokens)
            return
        for n, line in enumerate(fh, start=1):
            if line.isspace() or not line:
                continue
            yield _decode_one(n, line, block_tokens)


def iter_trace(path: str | Path, *, block_tokens: int | None = None) -> Iterator[TraceRow]:
    """Stream the rows of a trace file; raise :class:`TraceFormatError` at the first bad record.

    ``block_tokens``: if given, also require ``len(hash_ids) == ceil(input_length / block_tokens)``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist")
    for item in _records(path, block_tokens):
        if isinstance(item, TraceIssue):
            raise TraceFormatError(str(path), [item])
        yield item


def load_trace(path: str | Path, *, limit: int | None = None, block_tokens: int | None = None,
               max_errors: int = 20) -> list[TraceRow]:
    """Read a whole trace (the first ``limit`` rows if given), validating every record.

    All malformed records (up to ``max_errors``) are collected and raised together in one
    :class:`TraceFormatError`, so a user sees every bad line at once.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist")
    rows: list[TraceRow] = []
    issues: list[TraceIssue] = []
    truncated = False
    for item in _records(path, block_tokens):
        if isinstance(item, TraceIssue):
            if len(issues) >= max_errors:
                truncated = True
                break
            issues.append(item)
            continue
        rows.append(item)
        if limit is not None and len(rows) >= limit:
            break
    if issues:
        raise TraceFormatError(str(path), issues, truncated=truncated)
    return rows


_ENCODER = msgspec.json.Encoder()


def encode_row(row: TraceRow) -> bytes:
    ts = row.timestamp
    if isinstance(ts, float) and ts.is_integer():
        row = msgspec.structs.replace(row, timestamp=int(ts))
    return _ENCODER.encode(row)


def write_trace(path: str | Path, rows: Iterable[TraceRow]) -> int:
    """Write rows as JSON lines (gzip if the name ends in ``.gz``); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    n = 0
    with opener(path, "wb") as fh:
        for row in rows:
            fh.write(encode_row(row))
            fh.write(b"\n")
            n += 1
    return n


def trace_stats(rows: list[TraceRow], block_tokens: int = 512) -> dict:
    """Shape of a trace and the best prefix hit rate an infinite shared cache could reach."""
    if not rows:
        return {"requests": 0}
    seen: set[int] = set()
    reusable_tokens = 0
    total_in = 0
    for r in rows:
        total_in += r.input_length
        for i, h in enumerate(r.hash_ids):
            if h in seen:
                reusable_tokens += min(block_tokens, max(0, r.input_length - i * block_tokens))
            else:
                # blocks after the first unseen one are not a reusable *prefix*
                break
        seen.update(r.hash_ids)
    span_s = (max(r.timestamp for r in rows) - min(r.timestamp for r in rows)) / 1000.0
    return {
        "requests": len(rows),
        "duration_s": span_s,
        "rate_rps": len(rows) / span_s if span_s > 0 else None,
        "input_tokens_mean": total_in / len(rows),
        "output_tokens_mean": sum(r.output_length for r in rows) / len(rows),
        "unique_blocks": len(seen),
        "ideal_prefix_hit_rate": reusable_tokens / total_in if total_in else 0.0,
    }
