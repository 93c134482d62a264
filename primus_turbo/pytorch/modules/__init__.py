"""``nn.Module`` wrappers over Turbo ops."""

from primus_turbo.pytorch.modules.linear import Linear

__all__ = ["Linear"]
