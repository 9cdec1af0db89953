"""deploykit's native code: building ``csrc/`` and ``plugins/`` (``build``), the kernel library over its C
ABI (``kernels``), and what native libraries print (``stderr``)."""
