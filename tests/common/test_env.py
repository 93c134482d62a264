"""``env_reader``: the hot-path environment reader sees every change made through ``os.environ``."""

from __future__ import annotations

import os
from unittest import mock

from primus_turbo.common import env


def test_reader_follows_os_environ(monkeypatch):
    monkeypatch.delenv("PRIMUS_TURBO_TEST_ENV", raising=False)
    read = env.env_reader("PRIMUS_TURBO_TEST_ENV")
    assert read() is None
    monkeypatch.setenv("PRIMUS_TURBO_TEST_ENV", "cached")
    assert read() == "cached"
    with mock.patch.dict(os.environ, {"PRIMUS_TURBO_TEST_ENV": "ä"}):
        assert read() == "ä"
    assert read() == "cached"
    monkeypatch.delenv("PRIMUS_TURBO_TEST_ENV")
    assert read() is None


def test_reader_without_the_backing_dict(monkeypatch):
    """Where ``os.environ`` has no backing dict (another Python), the reader is ``os.environ.get``."""
    monkeypatch.setattr(os, "environ", {"PRIMUS_TURBO_TEST_ENV": "1"})
    assert env.env_reader("PRIMUS_TURBO_TEST_ENV")() == "1"
    assert env.env_reader("PRIMUS_TURBO_TEST_ENV_UNSET")() is None
