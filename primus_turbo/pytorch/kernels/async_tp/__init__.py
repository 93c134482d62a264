"""Tensor-parallel collectives fused with GEMMs (async TP) as custom ops."""
