"""Custom ops (``torch.ops.primus_turbo.*``) and the backends each one dispatches to."""
