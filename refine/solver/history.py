"""The run history: one row per loop point, kept once for the result file, the checkpoint and the callbacks.

A row holds the global ``step`` (0, 1, ... over the whole run), the ``stage`` index, the ``stage_step``
(the loop's own step counter, 0 = the stage's start), the ``loss``, the gradient norm ``grad_norm`` in the
loop's (preconditioned) coordinates, ``elapsed_s`` (the stage's loop time at that point, wall seconds: row 0
is its first evaluation, compiles and a GPU's graph capture included; NaN in rows of a file written before it
was kept), and every canonical value (plus ``orient_x/y/z``) under ``params``.
A name that first appears in a later stage is padded backwards with its first value, so every column
has one entry per row and no NaN (the result file stores them as plain arrays).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["History", "COLUMNS"]

#: the scalar columns; ``params`` (name -> column) is beside them
COLUMNS = ("step", "stage", "stage_step", "loss", "grad_norm", "elapsed_s")


class History:
    """Columns of the run so far.  :meth:`to_dict` is the form stored in results and checkpoints."""

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        data = data or {}
        self.columns: dict[str, list] = {c: list(data.get(c, ())) for c in COLUMNS}
        rows = len(self.columns["step"])
        for values in self.columns.values():  # a column an older file lacks: NaN
            values.extend([math.nan] * (rows - len(values)))
        self.params: dict[str, list[float]] = {k: list(v) for k, v in dict(data.get("params", {})).items()}

    def __len__(self) -> int:
        return len(self.columns["step"])

    def append(self, stage_index: int, stage_step: int, loss: float, grad_norm: float,
               values: Mapping[str, float], elapsed_s: float = math.nan) -> int:
        """Add one row; returns its global step."""
        step = len(self)
        for column, value in zip(COLUMNS, (step, stage_index, stage_step, loss, grad_norm, elapsed_s)):
            self.columns[column].append(value)
        for name, value in values.items():
            column = self.params.setdefault(name, [])
            column.extend([value] * (step - len(column)))  # a name that appears later: pad with its value
            column.append(value)
        return step

    def first_loss(self, stage_index: int) -> float | None:
        """The loss of the first row of a stage (None if the stage has no row)."""
        for stage, loss in zip(self.columns["stage"], self.columns["loss"]):
            if stage == stage_index:
                return float(loss)
        return None

    def up_to(self, stage_index: int, stage_step: int) -> "History":
        """The rows of the stages before ``stage_index`` and of that stage up to ``stage_step`` (-1: none of
        it): what a checkpoint written at that point holds."""
        keep = [i for i, (st, ss) in enumerate(zip(self.columns["stage"], self.columns["stage_step"]))
                if st < stage_index or (st == stage_index and ss <= stage_step)]
        out = History()
        out.columns = {c: [v[i] for i in keep] for c, v in self.columns.items()}
        out.params = {k: [v[i] for i in keep] for k, v in self.params.items()}
        return out

    def to_dict(self) -> dict:
        """``{column: list, ..., "params": {name: list}}`` (copies)."""
        return {c: list(v) for c, v in self.columns.items()} | {"params": {k: list(v) for k, v in self.params.items()}}
