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


def function_path() -> Parser[str]:
    """A ``package.module:function`` name (whether it imports is for the switch to check at install)."""
    allowed = "a package.module:function name"

    def parse(key: str, raw: str) -> str:
        module, sep, function = raw.strip().partition(":")
        if not sep or not function.isidentifier() or not all(part.isidentifier() for part in module.split(".")):
            raise ConfigError(key, raw, allowed)
        return raw.strip()

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
    """A profile file read as ``docker run --env-file`` reads it, so a container and ``check`` see the
    same keys: one ``KEY=VALUE`` a line, split at the first ``=``; lines whose first non-blank
    character is ``#`` and blank lines are skipped; the key loses its leading blanks and may hold
    none; the value is taken as it stands (no quote removal, no ``$`` expansion, no inline comment,
    no trimming). A later line of a key wins.

    Refused, each with the line: a line without ``=`` (docker passes the caller's variable of that
    name through: a profile states its values), a key with a blank in it, and a value that docker
    and compose's ``env_file`` read differently (compose strips quotes and surrounding blanks, cuts
    `` #`` comments and expands ``$``): one that starts or ends with a blank or a quote, or holds
    ``$`` or `` #``."""
    values: dict[str, str] = {}
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.lstrip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        key, has_value, value = line.partition("=")
        if not has_value:
            raise ConfigError(where, raw, "KEY=VALUE (docker's --env-file would pass the caller's variable through)")
        if not key or any(c.isspace() for c in key):
            raise ConfigError(where, raw, "a key with no blank in it before the first '=' (one KEY=VALUE a line)")
        quotes = ("'", '"')
        if value != value.strip() or value[:1] in quotes or value[-1:] in quotes or "$" in value or " #" in value:
            raise ConfigError(where, raw, "a value without quotes, '$', ' #' or surrounding blanks (docker's "
                              "--env-file keeps them as they stand, compose's env_file does not)")
        values[key] = value
    return values
