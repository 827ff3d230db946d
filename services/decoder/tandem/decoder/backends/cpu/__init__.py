"""The CPU backend's step executor and its C kernels, built at install time for several ISA levels."""
