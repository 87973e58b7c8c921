"""The warnings zerodp logs, collected for a test to read (in-process tests and the subprocess workers alike)."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def zerodp_warnings() -> Iterator[list[str]]:
    """Yields the list the "zerodp" logger's warnings (and worse) are appended to while the block runs."""
    handler = _Collect()
    logging.getLogger("zerodp").addHandler(handler)
    try:
        yield handler.messages
    finally:
        logging.getLogger("zerodp").removeHandler(handler)
