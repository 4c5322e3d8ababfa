"""Trace files: recorded load to replay, one request a row, as CSV (with a header) or JSON Lines.

Each row names when the request arrived (seconds from the start of the
trace, or a date and time), how long its prompt was and how many tokens it
produced; an optional `conversation` groups requests whose prompts share a
prefix. Column names are case-insensitive, and those of other tools and
published traces are understood too (`timestamp`, `prompt_tokens`,
`completion_tokens`, ...; the Azure LLM inference traces' `TIMESTAMP`,
`ContextTokens`, `GeneratedTokens`); date-time arrivals (ISO 8601, as those
traces write them) become seconds from the earliest. A row that cannot be
read stops the load with its line number, rather than replaying a trace
different from the one recorded.
"""

import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pdrt.bench.workloads import RequestShape
from pdrt.errors import ConfigError

COLUMNS = {
    "arrival_s": ("arrival_s", "arrival_time", "arrival", "timestamp", "time"),
    "input_tokens": ("input_tokens", "input_len", "input_length", "prompt_tokens", "prompt_len", "contexttokens"),
    "output_tokens": ("output_tokens", "output_len", "output_length", "completion_tokens", "max_tokens",
                      "generatedtokens"),
}


@dataclass(slots=True, frozen=True)
class TraceRow:
    arrival_s: float
    shape: RequestShape


def _pick(row: dict, field: str, where: str) -> object:
    for name in COLUMNS[field]:
        if name in row and row[name] not in (None, ""):
            return row[name]
    raise ConfigError(f"{where}: no {field} (a column named one of {', '.join(COLUMNS[field])})")


def _number(value: object, field: str, where: str, kind: type) -> float | int:
    """A float, or an int (which "12" and 12.0 are, and 12.5 is not), from a CSV string or a JSON value."""
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {field} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{where}: {field} must be finite, got {value!r}")
    if kind is int:
        if not number.is_integer():
            raise ConfigError(f"{where}: {field} must be an integer, got {value!r}")
        return int(number)
    return number


def _arrival(value: object, where: str) -> float | datetime:
    """Seconds from the trace's start, or the date and time of an ISO 8601 string."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            try:
                return datetime.fromisoformat(value.strip())
            except ValueError:
                raise ConfigError(f"{where}: arrival_s must be seconds or an ISO 8601 date-time, got {value!r}") \
                    from None
    arrival = _number(value, "arrival_s", where, float)
    if arrival < 0:
        raise ConfigError(f"{where}: arrival_s must be >= 0, got {arrival}")
    return arrival


def _row(raw: dict, where: str) -> tuple[float | datetime, RequestShape]:
    raw = {str(name).strip().lower(): value for name, value in raw.items()}
    arrival = _arrival(_pick(raw, "arrival_s", where), where)
    inp = _number(_pick(raw, "input_tokens", where), "input_tokens", where, int)
    out = _number(_pick(raw, "output_tokens", where), "output_tokens", where, int)
    if inp < 1 or out < 1:
        raise ConfigError(f"{where}: input_tokens and output_tokens must be >= 1, got {inp} and {out}")
    conversation = raw.get("conversation")
    conversation = -1 if conversation in (None, "") else _number(conversation, "conversation", where, int)
    return arrival, RequestShape(inp, out, conversation)


def _csv_rows(path: Path) -> list[tuple[float | datetime, RequestShape]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames:
            raise ConfigError(f"{path}: empty, or no header row")
        return [_row(raw, f"{path}:{reader.line_num}") for raw in reader]


def _jsonl_rows(path: Path) -> list[tuple[float | datetime, RequestShape]]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: each line must be a JSON object")
        rows.append(_row(raw, where))
    return rows


def read_trace(path: str | Path) -> list[TraceRow]:
    """The rows of a .csv or .jsonl/.json trace, in order of arrival."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no trace file at {path}")
    rows = _csv_rows(path) if path.suffix.lower() == ".csv" else _jsonl_rows(path)
    if not rows:
        raise ConfigError(f"{path}: the trace has no requests")
    times = [arrival for arrival, _ in rows if isinstance(arrival, datetime)]
    if times and len(times) != len(rows):
        raise ConfigError(f"{path}: arrivals mix date-times and seconds")
    if times:
        if len({t.tzinfo is None for t in times}) > 1:
            raise ConfigError(f"{path}: arrivals mix date-times with and without a time zone")
        start = min(times)
        rows = [((arrival - start).total_seconds(), shape) for arrival, shape in rows]  # type: ignore[operator]
    return sorted((TraceRow(float(arrival), shape) for arrival, shape in rows), key=lambda r: r.arrival_s)
