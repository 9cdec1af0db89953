"""PyTorch: the reference every conversion is validated against."""
