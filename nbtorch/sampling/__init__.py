"""What is sampled: the beam's sources (divergence, dispersion, source files) and the C program's random numbers (mosaic domains, random misset, noise)."""
