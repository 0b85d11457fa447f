"""Service logging: human-readable by default, JSON lines with EMBER_LOG_FORMAT=json (what
`ember up` uses), each record carrying the service name and the request id being served."""
from __future__ import annotations

import contextvars
import json
import logging
import os
import time

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                 "level": record.levelname, "service": self.service, "logger": record.name,
                 "message": record.getMessage()}
        if rid := request_id.get():
            entry["request_id"] = rid
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get() or "-"
        return True


def setup(service: str) -> None:
    handler = logging.StreamHandler()
    if os.environ.get("EMBER_LOG_FORMAT") == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s [%(request_id)s] %(message)s"))
    handler.addFilter(_RequestIdFilter())
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
