"""OpenVINO on the CPU: a bundle's OpenVINO model (fp32, or int8 quantized by NNCF)."""
