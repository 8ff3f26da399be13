"""Typed parsers for ``DSV41_*`` values: the one place a configuration value is read.

Every parser takes the key and the raw string and returns a typed value or raises
:class:`ConfigError` naming the key, the value and what is allowed. Switch modules never read
``os.environ`` themselves; they get their parsed values from :mod:`adapter.core.registry`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

PREFIX = "DSV41_"

FLAG_TRUE = ("1", "true", "on", "yes")
FLAG_FALSE = ("0", "false", "off", "no", "")
FLAG_SPELLINGS = "1/0, true/false, on/off, yes/no (any case)"


class ConfigError(ValueError):
    """A configuration value that cannot be used. The message is the whole diagnosis."""

    def __init__(self, key: str, value: str, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r} is not valid: expected {allowed}")


@dataclass(frozen=True)
class Parser(Generic[T]):
    """A parse function plus the sentence that says what it accepts (used in errors and docs)."""

    parse: Callable[[str, str], T]
    allowed: str

    def __call__(self, key: str, raw: str) -> T:
        return self.parse(key, raw)


def flag() -> Parser[bool]:
    def parse(key: str, raw: str) -> bool:
        low = raw.strip().lower()
        if low in FLAG_TRUE:
            return True
        if low in FLAG_FALSE:
            return False
        raise ConfigError(key, raw, FLAG_SPELLINGS)

    return Parser(parse, FLAG_SPELLINGS)


def integer(lo: int, hi: int | None = None, *, multiple_of: int = 1, unit: str = "") -> Parser[int]:
    """An integer in ``[lo, hi]`` (``hi`` None: no upper bound) that is a multiple of ``multiple_of``."""
    parts = [f"an integer {lo}..{hi}" if hi is not None else f"an integer >= {lo}"]
    if multiple_of > 1:
        parts.append(f"a multiple of {multiple_of}")
    allowed = ", ".join(parts) + (f" ({unit})" if unit else "")

    def parse(key: str, raw: str) -> int:
        text = raw.strip()
        if not text or not (text.isdigit() or (text[0] in "+-" and text[1:].isdigit())):
            raise ConfigError(key, raw, allowed)
        value = int(text)
        if value < lo or (hi is not None and value > hi) or value % multiple_of:
            raise ConfigError(key, raw, allowed)
        return value

    return Parser(parse, allowed)


def percent() -> Parser[int]:
    """A share in whole percent, 1..99: 0 and 100 are not shares (unset the key to turn it off)."""
    return integer(1, 99, unit="percent; unset the key to turn the switch off")


def choice(*options: str) -> Parser[str]:
    allowed = "one of " + ", ".join(options)

    def parse(key: str, raw: str) -> str:
        low = raw.strip().lower()
        if low not in options:
            raise ConfigError(key, raw, allowed)
        return low

    return Parser(parse, allowed)


def absolute_path() -> Parser[str]:
    """An absolute filesystem path (whether it exists is for the switch to check at install)."""
    allowed = "an absolute path (starting with /)"

    def parse(key: str, raw: str) -> str:
        text = raw.strip()
        if not text.startswith("/") or any(c in text for c in "\n\r\0"):
            raise ConfigError(key, raw, allowed)
        return text

    return Parser(parse, allowed)


def dsv41_items(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(PREFIX)}


def closest_key(unknown: str, known: list[str]) -> str | None:
    found = difflib.get_close_matches(unknown, known, n=1, cutoff=0.6)
    return found[0] if found else None


def read_env_file(path: str) -> dict[str, str]:
    """Read ``KEY=VALUE`` words from a profile file.

    Lines may use ``export``, quotes and several assignments per line (a production line that
    ends with the switches); words that are not assignments (launch arguments) are skipped.
    Comments and blank lines are ignored. A later assignment of a key wins, like a shell.
    """
    import shlex

    values: dict[str, str] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            try:
                words = shlex.split(line, comments=True)
            except ValueError as exc:
                raise ConfigError(f"{path}:{number}", line.strip(), f"a shell-quoted line ({exc})") from None
            for word in words:
                if word == "export" or "=" not in word:
                    continue
                key, _, value = word.partition("=")
                if key.replace("_", "").isalnum() and not key[0].isdigit():
                    values[key] = value
    return values
