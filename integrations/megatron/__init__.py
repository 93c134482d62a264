"""Megatron-Core integration, installed as ``primus_turbo.integrations.megatron``.

The spec provider and the ``--enable-primus-turbo`` switch live here; the GEMM they build on is
``primus_turbo.pytorch.ops.gemm`` with ``fuse_bgrad_accum_pattern="megatron"``.
"""

__all__: list[str] = []
