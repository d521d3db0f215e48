"""The CPU backend: the C++ kernel (an XLA FFI custom call built with the system compiler on first use) and its Python
side."""
