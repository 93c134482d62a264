"""DeepEP-compatible expert-parallel communication (``Buffer``, ``Config``, ``EventOverlap``)."""

from primus_turbo.pytorch.deep_ep.buffer import Buffer, Config, EventOverlap, Handle

__all__ = ["Buffer", "Config", "EventOverlap", "Handle"]
