"""Framework integrations, installed as ``primus_turbo.integrations``."""
