"""The ``nbtorch-refine`` command: argv parsed at the door into options, then the single-image or many-image run."""
