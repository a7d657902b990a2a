"""Environment switches: the ``SPECFORGE_*`` variables that choose a kernel or turn a behaviour off."""

from __future__ import annotations

import os


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable ``name``, stripped and lower-cased: one of ``choices``, or ``""`` when unset or
    empty; any other value raises, naming the variable and what it takes (a misspelt switch is not ignored)."""
    value = os.environ.get(name, "").strip().lower()
    if value and value not in choices:
        raise ValueError(f"{name}={os.environ[name]!r}: expected {' or '.join(choices)}, or unset")
    return value
