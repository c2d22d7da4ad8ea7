"""Runtime and compile policy: eager or torch.compile, the cache folder, precompiled kernels, the vector-ISA probe, the Jacobian's compiled kernels."""
