"""ONNX Runtime: sessions over deploykit graphs (CPU, CUDA execution provider) with our op library."""
