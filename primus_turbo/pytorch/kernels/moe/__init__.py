"""MoE routing custom ops."""
