"""The server's log: text or JSON lines (``--log-format``), at ``--log-level``, and the access log.

A record may carry structured fields as ``extra={"fields": {...}}``: the JSON format writes
them as keys of the line, the text format keeps its message (which says the same in words).
Every line of the JSON format is one object: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
``message``, the record's fields, and ``exception`` (its traceback) when there is one.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Mapping
from typing import Literal

LogFormat = Literal["text", "json"]
LogLevel = Literal["debug", "info", "warning", "error"]

#: One line per answered HTTP request (service.middleware), at INFO.
ACCESS = logging.getLogger("splitkey.access")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            line.update({k: v for k, v in fields.items() if k not in line})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, default=str, separators=(",", ":"))


def configure(log_format: LogFormat, level: LogLevel) -> None:
    """The root logger writes to stderr in ``log_format`` at ``level`` (replacing any handler it had)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def access(method: str, route: str, status: int, bytes_in: int, bytes_out: int, seconds: float, request_id: str,
           timing: bytes) -> None:
    """The access-log line of one answered request: its stages in milliseconds, read from its ``Server-Timing``
    header (``timing``: ``parse;dur=1.234, total;dur=2``; empty: none) only when the line is written."""
    if not ACCESS.isEnabledFor(logging.INFO):
        return
    stages: dict[str, float] = {}
    for part in timing.decode("latin-1").split(",") if timing else ():
        name, _, params = part.strip().partition(";")
        for param in params.split(";"):
            key, _, number = param.strip().partition("=")
            if key == "dur" and name:
                try:
                    stages[name] = float(number)
                except ValueError:
                    pass
    ms = round(seconds * 1000, 3)
    text_stages = ",".join(f"{k}={v:g}" for k, v in stages.items())
    ACCESS.info("%s %s %d in=%d out=%d %.3fms id=%s%s", method, route, status, bytes_in, bytes_out, ms, request_id,
                f" stages={text_stages}" if stages else "",
                extra={"fields": {"method": method, "route": route, "status": status, "bytes_in": bytes_in,
                                  "bytes_out": bytes_out, "duration_ms": ms, "request_id": request_id,
                                  "stages_ms": dict(stages)}})
