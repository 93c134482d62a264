"""Training-step throughput benchmarks (Megatron end to end)."""
