"""Logging a dependency's outage once: the first failure as a warning, the recovery as an
info line, nothing for the failures in between (a loop retrying every second would
otherwise fill the log)."""

from __future__ import annotations

import logging


class OutageLog:
    def __init__(self, log: logging.Logger, failing: str, recovered: str):
        self._log, self._failing_text, self._recovered_text = log, failing, recovered
        self.failing = False

    def failed(self, exc: BaseException) -> None:
        if not self.failing:
            self._log.warning("%s: %s", self._failing_text, exc)
        self.failing = True

    def ok(self) -> None:
        if self.failing:
            self._log.info(self._recovered_text)
        self.failing = False
