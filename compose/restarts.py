"""When the local launcher may restart a service that exited on its own: exponential
backoff per service (`initial_s`, doubling up to `max_s`), back to `initial_s` once the
service has run for `stable_s` since its last restart -- compose's `restart: always`
with a delay, for `pagedserve up`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RestartBackoff:
    initial_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0
    _delay: dict[str, float] = field(default_factory=dict)  # service → its next delay
    _died_at: dict[str, float] = field(default_factory=dict)  # service → when it was seen dead
    _started_at: dict[str, float] = field(default_factory=dict)  # service → its last restart

    def due(self, name: str, now: float) -> float | None:
        """Seconds to wait before restarting `name`, dead at `now` (0: restart now)."""
        died = self._died_at.setdefault(name, now)
        if died - self._started_at.get(name, float("-inf")) >= self.stable_s:
            self._delay[name] = 0.0  # it ran long enough (or never restarted): at once
        return max(0.0, died + self._delay.get(name, 0.0) - now)

    def restarted(self, name: str, now: float) -> None:
        """`name` was restarted at `now`: the next restart waits longer."""
        self._died_at.pop(name, None)
        self._started_at[name] = now
        delay = self._delay.get(name, 0.0)
        self._delay[name] = min(self.max_s, max(self.initial_s, delay * 2))
