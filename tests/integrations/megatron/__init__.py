"""Tests of the Megatron-Core integration and the harness that runs megatron-core on CPU or GPU."""
