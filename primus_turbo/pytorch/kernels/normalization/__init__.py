"""Normalization custom ops."""
