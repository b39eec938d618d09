"""Triton pack/unpack kernels over region tables (installed as nereus_comm.kernels)."""
