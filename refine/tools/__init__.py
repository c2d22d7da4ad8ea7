"""Tools that are not the library: the refinement benchmark harness (``python -m refine.tools.bench``)."""
