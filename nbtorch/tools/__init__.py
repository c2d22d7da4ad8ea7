"""Tools run from the command line that are not the library: nothing in nbtorch imports them.

* ``gradcheck_report``: autograd against finite differences for every parameter
  (``python -m nbtorch.tools.gradcheck_report``; its probes drive ``tests/gradients``);
* ``bench``: the benchmark harness (``python -m nbtorch.tools.bench``, ``docs/performance.md``).

``python -m nbtorch.gradcheck_report`` and ``python -m nbtorch.bench`` still run them.
"""
