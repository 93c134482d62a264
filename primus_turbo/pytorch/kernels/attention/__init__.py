"""Flash attention custom ops and backends."""
