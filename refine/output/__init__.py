"""What a finished refinement leaves: the result object and files, the printed table, figures, the HTML report, and callbacks that watch a run."""
