"""Framework-independent helpers: logging, environment-variable names and platform detection."""

from primus_turbo.common import constants, platform
from primus_turbo.common.logger import get_logger

__all__ = ["constants", "get_logger", "platform"]
