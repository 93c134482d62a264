"""Optimizer custom ops."""
