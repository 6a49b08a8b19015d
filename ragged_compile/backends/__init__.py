"""Device kernels of the ragged attention op. `flashinfer` is the CUDA one."""
