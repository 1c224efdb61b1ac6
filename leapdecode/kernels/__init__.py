"""The C++ CPU kernels (``*.cpp``, compiled on first use) and :mod:`leapdecode.kernels.build`, which builds them."""
