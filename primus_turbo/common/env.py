"""Environment variables read on hot paths (every launch, every op call).

``os.environ.get`` encodes the key on every call and, for an unset variable, raises and catches a
``KeyError`` inside ``Mapping.get``: 2-4 us a read on a slow host, as much as the rest of a cached kernel
launch. ``env_reader(name)`` returns a reader that looks the pre-encoded key up in ``os.environ``'s backing
dict instead. A change made through ``os.environ`` (``monkeypatch.setenv``, ``mock.patch.dict``) shows at
once, as with ``os.environ.get``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

__all__ = ["env_reader"]


def env_reader(name: str) -> Callable[[], str | None]:
    """A zero-argument reader of environment variable ``name``: its value, or None when it is unset."""
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    decode = getattr(os.environ, "decodevalue", None)
    if not isinstance(data, dict) or encode is None or decode is None:
        return functools.partial(os.environ.get, name)
    key, get = encode(name), data.get

    def read() -> str | None:
        raw = get(key)
        return None if raw is None else decode(raw)

    return read
