"""TensorRT and TensorRT-RTX: building engines with our plugins embedded, and running them."""
