"""Dense GEMM custom ops and backends."""
