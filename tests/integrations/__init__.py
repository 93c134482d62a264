"""Tests of the framework integrations (``primus_turbo.integrations``)."""
