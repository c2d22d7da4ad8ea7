"""Experiments run from the checkout (``python -m experiments.<name>``); nothing imports them.

* ``parity_report``: every golden C case through the simulator, with errors and timings.
"""
