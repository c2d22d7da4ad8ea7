"""Experiments run from the checkout (``python -m experiments.<name>``); nothing imports them.

* ``parity_report``: every golden C case through the simulator, with errors and timings;
* ``stage_a_mapping``: the Stage-A debug phases (forward sanity, raw <-> physical mapping and
  gradients, eager and compiled Adam runs, their trajectories compared);
* ``sweep``: optuna hyper-parameter sweeps of the refinement (``workload`` and ``png``
  are their helpers: nbtorch-refine's options and preparation as the scripts' input, and a minimal PNG
  writer);
* their argument checks and one-line errors (exit status 2) come from :mod:`nbtorch.cli.support`.

See docs/stage-a.md and docs/hyperparameter-sweeps.md.
"""
