"""The library's stdlib logger; its level comes from ``PRIMUS_TURBO_LOG_LEVEL`` (default WARNING)."""

import logging
import os

from primus_turbo.common.constants import ENV_LOG_LEVEL

__all__ = ["get_logger", "log_once"]

_ROOT = "primus_turbo"
_logged_once: set[str] = set()


def _configure_root() -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
        root.addHandler(handler)
        root.propagate = False
    level_name = os.environ.get(ENV_LOG_LEVEL, "WARNING").strip().upper() or "WARNING"
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        raise ValueError(
            f"{ENV_LOG_LEVEL}={level_name!r} is not a logging level; "
            "use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    root.setLevel(level)
    return root


_configure_root()


def get_logger(name: str = _ROOT) -> logging.Logger:
    """Return a child of the ``primus_turbo`` logger (``name`` is usually ``__name__``)."""
    if name == _ROOT or name.startswith(_ROOT + "."):
        return logging.getLogger(name)
    return logging.getLogger(f"{_ROOT}.{name}")


def log_once(logger: logging.Logger, level: int, message: str) -> None:
    """Log ``message`` the first time it is seen in this process, so hot paths do not flood the log."""
    if message in _logged_once:
        return
    _logged_once.add(message)
    logger.log(level, message)
