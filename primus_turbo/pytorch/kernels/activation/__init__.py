"""Gated-activation custom ops."""
