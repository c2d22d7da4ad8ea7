"""The starting amplitudes of a run, held once per process and read by every image's values.

A run that refines structure factors carries one starting amplitude per candidate reflection (``F_h_k_l``,
:mod:`refine.fitting.structure_factors`) in the values of every image and parameter map: a joint run of many
stills has the same thousands of numbers in each.  As separate dicts they cost about 30 bytes a name and image
(a 10^4-name dict is ~0.3 MB), three copies an image (its prepared values, its map's values, its map's start).
Here they are one :class:`AmplitudeValues` per process, and an image's values are :func:`layered`: a
:class:`collections.ChainMap` whose first layer holds the image's own names (cell, orientation, scale ...) and
whose last is the shared amplitudes.  A lookup falls through to the shared layer; a write (``values[k] = v``,
``update``) lands in the image's own layer, so the shared one is never changed once a map holds it.

:class:`AmplitudeValues` also keeps the tensors made from it (:meth:`AmplitudeValues.cached`: the starting vector
in the table's order, a block's positions, on each dtype and device once), so that a parameter map's evaluation
makes no tensor from Python numbers and copies nothing to a GPU (:meth:`refine.fitting.parameters.ParameterMap.
physical_block`; a CUDA graph's capture forbids such copies, :mod:`nbtorch.runtime.cuda_graph`).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import Tensor

from refine.fitting.structure_factors import is_amplitude
from refine.fitting.transforms import multiplicative

__all__ = ["AmplitudeValues", "AmplitudeBlock", "layered", "shared_layer"]


class AmplitudeValues(dict):
    """name -> starting amplitude (float) of every candidate, shared by the images and maps of a process; never
    changed after it is made (a changed start is a new object).  ``cached(key, make)``: a value made once from it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._made: dict = {}

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()`` the first time ``key`` is asked, the same object after (tensors of the starts, positions)."""
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]


def layered(values: Mapping[str, Any], amplitudes: AmplitudeValues) -> ChainMap:
    """``values``' names other than the amplitudes (a new dict, the first layer) over the shared ``amplitudes``
    (values already layered give their own layers' names without going through their amplitudes)."""
    if isinstance(values, ChainMap) and isinstance(values.maps[-1], AmplitudeValues):
        own: dict = {}
        for m in reversed(values.maps[:-1]):
            own.update((k, v) for k, v in m.items() if not is_amplitude(k))
        return ChainMap(own, amplitudes)
    return ChainMap({k: v for k, v in values.items() if not is_amplitude(k)}, amplitudes)


def shared_layer(values: Mapping[str, Any], names: Collection[str]) -> AmplitudeValues | None:
    """The :class:`AmplitudeValues` under ``values`` when it is :func:`layered` (its last layer holds every one of
    ``names`` and no other layer has an amplitude), else None (then a caller copies the values it needs)."""
    if not isinstance(values, ChainMap) or not isinstance(values.maps[-1], AmplitudeValues):
        return None
    layer = values.maps[-1]
    if any(is_amplitude(k) for m in values.maps[:-1] for k in m) or not all(n in layer for n in names):
        return None
    return layer


class AmplitudeBlock:
    """A map's free amplitudes as one contiguous run of the raw vector, ``raw[start:stop]``, of
    :class:`~refine.fitting.transforms.Multiplicative` transforms of one ``step`` and ``limit``
    (:meth:`refine.fitting.parameters.ParameterMap.physical_block`).  ``names``: every amplitude of the space in the
    table's order; ``starts``: their shared starting values.  Its tensors (:meth:`tensor`) are made once per
    process's starts and kept (every image's map of a joint run reads the same ones): an evaluation makes none from
    Python numbers and copies none to a GPU."""

    def __init__(self, map_names: tuple, start: int, stop: int, step: float, limit: float | None, names: tuple,
                 starts: AmplitudeValues) -> None:
        self.map_names, self.start, self.stop, self.step, self.limit = map_names, start, stop, step, limit
        self.names, self.starts = names, starts
        # the shared cache's key holds the map's names tuple (a joint run's maps share one), not a new tuple
        self._key = ("block", start, stop, map_names)
        self._mine: dict = {}

    def tensor(self, what: str, dtype: torch.dtype, device) -> Tensor:
        """``reference`` (the free amplitudes' starts), ``where`` (their positions among :attr:`names`) or ``base``
        (every amplitude's start) in ``dtype`` on ``device``."""
        key = (what, dtype, str(device))
        if key not in self._mine:  # the shared cache's key hashes every name: looked up once per block
            self._mine[key] = self.starts.cached(
                (("base", self.names) if what == "base" else self._key, *key), lambda: self._make(what, dtype, device))
        return self._mine[key]

    def _make(self, what: str, dtype: torch.dtype, device) -> Tensor:
        if what == "base":
            return torch.tensor([self.starts[n] for n in self.names], dtype=dtype, device=device)
        free = self.map_names[self.start:self.stop]
        if what == "where":
            at = {n: i for i, n in enumerate(self.names)}
            return torch.tensor([at[n] for n in free], dtype=torch.long, device=device)
        return torch.tensor([self.starts[n] for n in free], dtype=dtype, device=device)

    def free(self, raw: Tensor) -> Tensor:
        """(stop - start,) the free amplitudes at ``raw`` (:class:`Multiplicative`'s formula on the run)."""
        return multiplicative(raw[self.start:self.stop], self.tensor("reference", raw.dtype, raw.device), self.step,
                              self.limit)

    def every(self, raw: Tensor) -> Tensor:
        """(len(names),) every amplitude at ``raw``: the free ones from it, the held ones at their starts."""
        free = self.free(raw)
        if self.stop - self.start == len(self.names):
            return free
        return self.tensor("base", raw.dtype, raw.device).index_put((self.tensor("where", raw.dtype, raw.device),),
                                                                    free)
