"""DIALS experiments as nanoBragg flags and simulators (single and multi-panel), and the refined geometry written back."""
