"""The raising helpers every check uses: one message naming the key, the value, the rule and a fix."""

from __future__ import annotations

from engine.config import ConfigError


def fail(key: str, value: object, rule: str, fix: str) -> None:
    raise ConfigError(f"{key}={value!r}: {rule}. Fix: {fix}")


def one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        fail(key, value, f"unknown value; known: {', '.join(allowed)}", f"set {key} to one of them")


def positive(key: str, value: float) -> None:
    if value <= 0:
        fail(key, value, "must be > 0", f"set {key} to a positive value")
