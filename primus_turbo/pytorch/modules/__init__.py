"""``nn.Module`` wrappers over Turbo ops."""

from primus_turbo.pytorch.modules.attention import TurboAttention
from primus_turbo.pytorch.modules.grouped_linear import GroupedLinear
from primus_turbo.pytorch.modules.linear import Float8Linear, Linear
from primus_turbo.pytorch.modules.normalization import RMSNorm
from primus_turbo.pytorch.modules.token_dispatcher import DeepEPTokenDispatcher

__all__ = ["DeepEPTokenDispatcher", "Float8Linear", "GroupedLinear", "Linear", "RMSNorm", "TurboAttention"]
