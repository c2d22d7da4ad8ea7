"""The ``nbtorch`` command: nanoBragg's flags, the command's body and printouts, and the plumbing shared by the command lines."""
