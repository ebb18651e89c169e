"""Command-line flags that also read `PAGEDSERVE_*` environment variables: the one mapping
every service's flags go through (the gateway's in gateway/config.py, the worker's and
the scheduler's in compose/flags.py).

`--some-flag` reads `PAGEDSERVE_SOME_FLAG`; a flag given on the command line wins over the
environment, the environment over the built-in default. A value from the environment is
a default to argparse, so it is converted by the flag's `type` and a bad one is reported
like a bad flag. A switch (`store_true`) is on when its variable is 1, true or yes. A
repeated flag (`--api-key`) takes one value from `PAGEDSERVE_API_KEY` and several,
comma-separated, from `PAGEDSERVE_API_KEYS`.

Groups of flags shared by several commands compose (`pagedserve engine` has the worker's,
the scheduler's and the gateway's): a flag added a second time is skipped, so the first
definition wins. This is why flags go through EnvFlags rather than straight to the parser:
it knows which flags the parser has without asking argparse's internals.

    flags = EnvFlags(argparse.ArgumentParser())
    flags.add("--port", type=int, default=8000, help="HTTP port")
    flags.switch("--protect-metrics", help="...")
    args = flags.parser.parse_args()
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

ENV_PREFIX = "PAGEDSERVE_"
_TRUE = ("1", "true", "yes")


def env_name(flag: str) -> str:
    """`--some-flag` → `PAGEDSERVE_SOME_FLAG`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


class EnvFlags:
    """Adds flags to one argparse parser, each with its environment variable as default."""

    def __init__(self, parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None):
        self.parser = parser
        self._environ = os.environ if environ is None else environ
        self._names: set[str] = set()

    def env(self, flag: str) -> str | None:
        """The flag's value in the environment, if set."""
        return self._environ.get(env_name(flag))

    def _claim(self, flag: str) -> bool:
        """True the first time a flag is named; later definitions are skipped."""
        if flag in self._names:
            return False
        self._names.add(flag)
        return True

    def add(self, flag: str, type: Callable[[str], Any] = str, default: Any = None, help: str = "",
            required: bool = False, choices: Sequence[str] | None = None) -> None:
        """A flag taking one value; `required` only while neither the environment nor a
        default gives one."""
        if not self._claim(flag):
            return
        value = self.env(flag)
        if value is not None:
            if choices is not None and value not in choices:
                self.parser.error(f"{env_name(flag)}={value!r}: choose from {', '.join(choices)}")
            default = value  # a string: argparse converts it with `type`, errors included
        self.parser.add_argument(flag, type=type, default=default, choices=choices,
                                 required=required and default is None,
                                 help=f"{help} (env {env_name(flag)})")

    def names(self, flag: str, help: str = "") -> None:
        """A flag taking one or more names (`--served-model-name a b`, or `a,b`), kept as
        one comma-separated string; from the environment, comma- or space-separated."""
        if not self._claim(flag):
            return
        value = self.env(flag)
        default = ",".join(value.replace(",", " ").split()) if value else None
        self.parser.add_argument(flag, nargs="+", action=_JoinNames, default=default,
                                 help=f"{help} (env {env_name(flag)})")

    def switch(self, flag: str, help: str = "") -> None:
        """An on/off flag: on when given, or when its variable is 1, true or yes."""
        if not self._claim(flag):
            return
        on = (self.env(flag) or "").strip().lower() in _TRUE
        self.parser.add_argument(flag, action="store_true", default=on,
                                 help=f"{help} (env {env_name(flag)}=1)")

    def repeated(self, flag: str, help: str = "") -> None:
        """A flag that may be given several times; the values from the environment
        (PAGEDSERVE_<FLAG> for one, PAGEDSERVE_<FLAG>S for several, comma-separated)
        come first."""
        if not self._claim(flag):
            return
        one, several = env_name(flag), env_name(flag) + "S"
        values = [self._environ.get(one, ""), *self._environ.get(several, "").split(",")]
        self.parser.add_argument(flag, action="append",
                                 default=[v.strip() for v in values if v.strip()],
                                 help=f"{help} (env {one}, or {several}=a,b)")


class _JoinNames(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, ",".join(n for v in values for n in v.replace(",", " ").split()))
