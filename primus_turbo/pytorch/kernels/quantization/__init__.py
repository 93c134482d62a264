"""FP8 quantization custom ops."""
