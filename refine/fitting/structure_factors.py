"""Structure factors as refinable parameters: one amplitude per symmetry-unique reflection.

A refinement of the group ``structure_factors`` frees one amplitude ``F_h_k_l`` (electrons, the
simulator's ``F_cell``) per symmetry-unique reflection that the fitted pixels can see.  Indices are
the Miller indices of the simulator's cell (nanoBragg's ``h = a . S``); ``h_k_l`` of a name is the
reflection gemmi puts in the reciprocal asymmetric unit of the space group, and every equivalent
``(h k l) R`` and Friedel mate ``-(h k l) R`` inside the table follows the same parameter.

The table (:class:`AmplitudeTable`) is the simulator's dense ``F[h - h_min, k - k_min, l - l_min]``
(:mod:`nbtorch.physics.structure`), built to cover every reflection the fitted pixels touch at the
start, with a margin: entries start at the ``-hkl`` file's value or ``-default_F``; systematically
absent reflections of the space group are 0 (their spots are not predicted).  Its amplitudes are the
*candidates*: every reflection to which the starting model gives at least 1 % of ``min_photons``
photons of Bragg signal (``scale x`` its share of the simulated image) on the fitted pixels, summed
over its equivalents (the start may be pixels away from the spots).  When the amplitudes' stage
starts, at the geometry refined so far, a candidate is *visible*, and refined, when the model with its
starting amplitude puts at least ``min_photons`` photons on the fitted pixels (:func:`amplitude_photons`);
the others are held at their starting value, and F(000) (the direct beam) is never refined.  Positive by construction: each amplitude is refined through
``F = F_start exp(L tanh(step raw / L))`` (:class:`refine.fitting.transforms.Multiplicative` with the limit
``L`` = :data:`AMPLITUDE_LIMIT`): within a factor 10^4 of its start either way, so that a line search's long trial
step along an amplitude the pixels hardly see gives a large finite loss, never an Inf one (on the real L-cysteine
sweep an unlimited ``exp`` made such trials Inf).

Starting values (``start``): ``"file"`` (the ``-hkl`` table), ``"one"`` (``-default_F`` for all, or the
table's rms over the free reflections when ``-default_F`` is 0) or
``"estimate"``: :func:`estimate_amplitudes`, a few multiplicative (Richardson-Lucy / EM) updates of
the Poisson likelihood with the geometry fixed, ``I_r <- I_r sum_p c_rp y_p / mu_p / sum_p c_rp``
(``c_rp``: photons reflection r puts in pixel p, ``y`` observed, ``mu`` model with background),
run when the stage that frees the amplitudes starts, at the geometry the earlier stages refined.

Restraint (optional, ``sigma`` relative): towards the mean amplitude of the reflection's resolution
bin (as diffBragg's), ``0.5 sum_r ((F_r - <F>_bin) / (sigma <F>_bin))^2`` with ``<F>_bin`` the current
mean of the free amplitudes in the bin (bins of equal counts, about 20 reflections each, at most 10),
so weak or partial reflections cannot run away; it enters the esds through its Gauss-Newton curvature.

Anomalous pairs (``anomalous``): F(+) of ``(h k l)`` with its equivalents ``(h k l) R`` and F(-) with theirs
``-(h k l) R`` are two amplitudes (F(-) named after ``-(h k l)``); a centric reflection, whose mate is one of its
equivalents, keeps one.  Their optional restraint (``anomalous_sigma``) is ``0.5 sum ((F+ - F-) / (sigma
(F+ + F-) / 2))^2`` over the pairs whose two amplitudes are candidates, a term of the same restraint.
"""

from __future__ import annotations

import logging
import math
import re
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from nbtorch.errors import InputError
from nbtorch.io.hkl import MAX_GRID_ELEMENTS
from nbtorch.io.reflections import rotation_parts
from refine.fitting.amplitude_restraint import AmplitudeRestraint  # noqa: F401 - named here too

__all__ = ["AmplitudeTable", "AmplitudeRestraint", "AmplitudeOptions", "amplitude_photons", "amplitude_photon_vector", "amplitude_name", "is_amplitude", "amplitude_hkl",
           "amplitude_table", "estimate_amplitudes", "check_space_group", "AMPLITUDE_STARTS", "DEFAULT_MIN_PHOTONS",
           "touched_range", "start_grid", "entry_photons", "table_from_photons", "em_sums", "em_update", "AMPLITUDE_LIMIT",
           "check_table_size"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^F_(-?\d+)_(-?\d+)_(-?\d+)$")
#: how the free amplitudes start
AMPLITUDE_STARTS = ("auto", "file", "one", "estimate")
#: an amplitude stays within e^AMPLITUDE_LIMIT (10^4) of its start either way (its transform's saturation)
AMPLITUDE_LIMIT = math.log(1e4)
#: Bragg photons on the fitted pixels below which a reflection's amplitude is not refined
DEFAULT_MIN_PHOTONS = 10.0
#: fraction of min_photons a reflection needs at the start to be a candidate
_CANDIDATE_FRACTION = 0.01
#: entries of the table beyond the reflections touched at the start (spots move while the geometry refines;
#: the tricubic interpolation's stencil reaches 2-3 entries out)
_MARGIN = 4


#: the key of a block of amplitudes in a dict of values (:meth:`AmplitudeTable.vector`)
AMPLITUDE_BLOCK = "__amplitude_block__"


def amplitude_name(hkl: Sequence[int]) -> str:
    """``F_h_k_l`` of reflection ``hkl`` (the name of its refinable amplitude)."""
    h, k, l = (int(x) for x in hkl)  # noqa: E741 - crystallographic name
    return f"F_{h}_{k}_{l}"


def is_amplitude(name: str) -> bool:
    """Whether ``name`` is an amplitude's name (``F_h_k_l``)."""
    return bool(_NAME.match(name))


def amplitude_hkl(name: str) -> tuple[int, int, int]:
    """``(h, k, l)`` of an amplitude's name."""
    m = _NAME.match(name)
    if m is None:
        raise InputError(f"{name!r} is not a structure-factor name (F_h_k_l)")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def _gemmi_group(space_group: str):
    try:
        import gemmi  # optional extra: only a run that refines structure factors needs it
    except ImportError:
        raise InputError("refining structure_factors needs gemmi (space groups): pip install 'nbtorch[formats]'") \
            from None
    try:
        return gemmi, gemmi.SpaceGroup(space_group)
    except (ValueError, RuntimeError):
        raise InputError(f"structure_factors: unknown space group {space_group!r} (give a full symbol such as "
                         f"P41212 with --symmetry)") from None


def asu_reflection(ops, asu, hkl, anomalous: bool) -> tuple[tuple[int, int, int], int]:
    """``(key, sign)`` of the reflection ``hkl``: ``key`` its reflection in gemmi's reciprocal asymmetric unit
    ``asu`` of the group's operations ``ops``, ``sign`` 0 when its amplitude is tied to its Friedel mate (not
    ``anomalous``, or centric), +1 for F(+) (reached without the Friedel flip: gemmi's ``isym`` odd), -1 for F(-)
    (the amplitude named after ``-key``)."""
    key, isym = asu.to_asu(list(hkl), ops)
    key = (int(key[0]), int(key[1]), int(key[2]))
    sign = (1 if isym % 2 else -1) if anomalous and not ops.is_reflection_centric(list(key)) else 0
    return key, sign


def check_space_group(space_group: str) -> str:
    """The Hermann-Mauguin symbol of ``space_group``; an unknown one (or no gemmi) is one error line."""
    return _gemmi_group(space_group)[1].hm


@dataclass
class AmplitudeTable:
    """The structure-factor table of a refinement and its free amplitudes.

    Attributes:
        space_group: Hermann-Mauguin symbol.
        hkl_min: (3,) int, the indices of entry ``[0, 0, 0]``.
        start: (nh, nk, nl) F of every entry when no parameter overrides it (electrons).
        index: (nh, nk, nl) int64, the free amplitude each entry follows, -1 for none.
        names: the free amplitudes' names (``F_h_k_l`` of the asymmetric-unit reflection).
        hkl: (n, 3) their asymmetric-unit indices; ``d_A`` (n,) their resolution (Å, starting cell).
        photons: (n,) Bragg photons the starting model puts on the fitted pixels (candidates).
        starts: name -> starting amplitude.
        start_mode: ``file``, ``one`` or ``estimate`` (then :func:`estimate_amplitudes` replaces ``starts``
            when the amplitudes' stage starts).
        signs: (n,) 0 for an amplitude its Friedel mates follow, +1 for F(+) and -1 for F(-) of an anomalous
            pair (``hkl`` of F(-): the mate of the asymmetric-unit reflection); None: all 0.
    """

    space_group: str
    hkl_min: np.ndarray
    start: np.ndarray
    index: np.ndarray
    names: tuple[str, ...]
    hkl: np.ndarray
    d_A: np.ndarray
    photons: np.ndarray
    starts: dict = field(default_factory=dict)
    start_mode: str = "one"
    signs: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.signs is None:
            self.signs = np.zeros(len(self.names), dtype=np.int64)
        flat = self.index.reshape(-1)
        self._where = np.nonzero(flat >= 0)[0]
        self._which = flat[self._where]
        self._cache: dict = {}

    @property
    def anomalous(self) -> bool:
        """Whether Friedel mates are refined apart."""
        return bool(np.any(self.signs != 0))

    def pairs(self) -> list[tuple[int, int]]:
        """``(i, j)``: the indices of F(+) and F(-) of every anomalous pair whose two amplitudes are candidates."""
        where = {tuple(int(x) for x in h): i for i, h in enumerate(self.hkl)}
        return [(i, where[tuple(int(-x) for x in h)]) for i, (h, s) in enumerate(zip(self.hkl, self.signs))
                if s > 0 and tuple(int(-x) for x in h) in where]

    @property
    def hkl_max(self) -> np.ndarray:
        return self.hkl_min + np.array(self.start.shape) - 1

    def _tensors(self, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        key = (dtype, str(device))
        if key not in self._cache:
            self._cache[key] = (torch.as_tensor(self.start.reshape(-1), dtype=dtype, device=device),
                                torch.as_tensor(self._where, device=device), torch.as_tensor(self._which, device=device))
        return self._cache[key]

    def vector(self, values: Mapping[str, Tensor | float], dtype: torch.dtype, device) -> Tensor:
        """(n,) the free amplitudes in ``values`` (tensors keep their gradients); a block ``values[AMPLITUDE_BLOCK]
        = (names, (m,) tensor)`` (:meth:`refine.fitting.parameters.ParameterMap.physical_block`) gives those names'
        amplitudes at once (all of them in the table's order: the block's vector itself), the others' come from
        ``values`` by name."""
        block = values.get(AMPLITUDE_BLOCK)
        if block is not None:
            names, vec = block
            if names is self.names or names == self.names:  # every amplitude, in the table's order
                return vec.to(dtype=dtype, device=device)
            where, rest = self._block_positions(names)
            base = torch.as_tensor([float(values[self.names[i]]) for i in rest], dtype=dtype, device=device)
            out = torch.zeros(len(self.names), dtype=dtype, device=device).index_put((rest.to(device),), base)
            return out.index_put((where.to(device),), vec.to(dtype=dtype, device=device))
        items = [values[n] for n in self.names]
        if not any(isinstance(v, Tensor) for v in items):
            return torch.as_tensor([float(v) for v in items], dtype=dtype, device=device)
        # a refinement's raw values live on the CPU, the model maybe on a GPU: the table goes where the model is
        return torch.stack([v.to(dtype=dtype, device=device) if isinstance(v, Tensor)
                            else torch.tensor(float(v), dtype=dtype, device=device)
                            for v in items])

    def _block_positions(self, names: tuple) -> tuple[Tensor, Tensor]:
        """The positions in the table of a block's ``names``, and of the other amplitudes (found once per block)."""
        key = ("block", names)
        if key not in self._cache:
            at = {n: i for i, n in enumerate(self.names)}
            where = [at[n] for n in names]
            inside = set(where)
            self._cache[key] = (torch.tensor(where, dtype=torch.long),
                                torch.tensor([i for i in range(len(self.names)) if i not in inside], dtype=torch.long))
        return self._cache[key]

    def grid(self, values: Mapping[str, Tensor | float], dtype: torch.dtype, device) -> Tensor:
        """The (nh, nk, nl) table with the free amplitudes of ``values`` put in (differentiable in them)."""
        start, where, which = self._tensors(dtype, device)
        F = self.vector(values, dtype, device)
        flat = start.index_put((where,), F[which])
        return flat.reshape(self.start.shape)

    def simulator(self, sim, values: Mapping[str, float]):
        """``sim`` (any simulator of the run, e.g. restricted to other pixels) holding this table with the
        amplitudes of ``values`` (e.g. the refined ones) put in."""
        with torch.no_grad():
            grid = self.grid({n: float(values.get(n, self.starts[n])) for n in self.names}, torch.float64, "cpu")
        return sim.with_structure_factors(grid.numpy(), self.hkl_min)

    def hkl_table(self, values: Mapping[str, float]):
        """The free amplitudes of ``values`` with every equivalent and Friedel mate, as an
        :class:`nbtorch.io.hkl.HKLTable` (a nanoBragg ``-hkl`` file knows no symmetry)."""
        from nbtorch.io.hkl import HKLTable  # noqa: PLC0415 - light module, only for writing

        rot = rotation_parts(*_gemmi_group(self.space_group))
        rows = [(eq, float(values.get(n, self.starts[n])))
                for n, key, sign in zip(self.names, self.hkl, self.signs) for eq in _members(rot, np.asarray(key), sign)]
        hkl = np.array([r[0] for r in rows], dtype=np.int64).reshape(-1, 3)
        return HKLTable(h=hkl[:, 0], k=hkl[:, 1], l=hkl[:, 2], F=np.array([r[1] for r in rows]))


def _touched_range(sim, overrides: dict, roi) -> tuple[np.ndarray, np.ndarray]:
    """Inclusive index bounds of the nearest reflections of every evaluation on the simulated pixels."""
    with torch.no_grad():
        _, _, diag = sim.render_pixels(roi=roi, diagnostics=True, **overrides)
    lo = diag["hkl0_min"].detach().cpu().numpy().round().astype(np.int64)
    hi = diag["hkl0_max"].detach().cpu().numpy().round().astype(np.int64)
    return lo - _MARGIN, hi + _MARGIN


def start_grid(sim, lo: np.ndarray, hi: np.ndarray, default_F: float) -> np.ndarray:
    """F over [lo, hi]: the simulator's table where it has a listed value, ``default_F`` elsewhere."""
    grid = np.full(tuple(hi - lo + 1), float(default_F), dtype=np.float64)
    s = sim.setup
    if s.F_grid is None:
        return grid
    old = np.asarray(s.F_grid, dtype=np.float64).copy()
    if s.F_present is not None:
        old[~np.asarray(s.F_present)] = default_F
    a = np.maximum(lo, s.hkl_min.astype(np.int64))
    b = np.minimum(hi, s.hkl_max.astype(np.int64))
    if np.all(b >= a):
        dst = tuple(slice(int(x - y), int(z - y + 1)) for x, y, z in zip(a, lo, b))
        src = tuple(slice(int(x - y), int(z - y + 1)) for x, y, z in zip(a, s.hkl_min.astype(np.int64), b))
        grid[dst] = old[src]
    return grid


def _photons_per_entry(sim, overrides: dict, roi, grid: np.ndarray, lo: np.ndarray, scale: float) -> np.ndarray:
    """Bragg photons (``scale x`` simulated) each table entry puts on the simulated pixels: ``F / 2 x`` the
    derivative of the summed image (the image is a sum of ``F^2`` times lattice terms)."""
    table = sim.with_structure_factors(grid, lo)
    F = torch.tensor(grid, dtype=sim.dtype, device=sim.device, requires_grad=True)
    with torch.enable_grad():
        image, _, _ = table.render_pixels(roi=roi, F_grid=F, **overrides)
        (g,) = torch.autograd.grad(image.sum(), F)
    return (scale * 0.5 * F.detach() * g).cpu().numpy()


def _equivalents(rot: np.ndarray, hkl: np.ndarray) -> np.ndarray:
    """(m, 3) the distinct equivalents and Friedel mates of one reflection; ``rot``: the space group's
    integer rotation parts (:func:`nbtorch.io.reflections.rotation_parts`)."""
    eq = np.einsum("j,mjk->mk", hkl, rot)
    return np.unique(np.concatenate([eq, -eq]), axis=0)


def _members(rot: np.ndarray, hkl: np.ndarray, sign: int) -> np.ndarray:
    """(m, 3) the reflections one amplitude stands for: with its Friedel mates (``sign`` 0), or only the
    equivalents ``hkl R`` (one member of an anomalous pair)."""
    return _equivalents(rot, hkl) if sign == 0 else np.unique(np.einsum("j,mjk->mk", hkl, rot), axis=0)


def amplitude_table(sim, values: Mapping[str, float], pixels, space_group: str, *, start: str = "auto",
                    min_photons: float = DEFAULT_MIN_PHOTONS, anomalous: bool = False):
    """The run's :class:`AmplitudeTable` and the simulator that holds it (module docstring).

    Arguments:
        sim: the simulator (its table, if any, gives the ``file`` start).
        values: the starting values (canonical names, ``orient_x/y/z``, ``scale``).
        pixels: (slow, fast) bool, the fitted pixels.
        space_group: full space-group symbol (``P41212``).
        start: ``auto`` (``file`` when the model has an ``-hkl`` table, else ``estimate``), ``file``,
            ``one`` or ``estimate`` (the starting table's values here; the estimate is made when the
            amplitudes' stage starts, :func:`estimate_amplitudes`).
        min_photons: Bragg photons a reflection needs on the fitted pixels to be refined.
        anomalous: F(+) and F(-) refined apart (module docstring).

    Returns:
        ``(table, simulator)``: the simulator is ``sim`` with the table (:meth:`Simulator.with_structure_factors`).
    """
    if start == "auto":
        start = "file" if sim.setup.F_grid is not None else "estimate"
    if start not in AMPLITUDE_STARTS:
        raise InputError(f"structure_factors: start must be one of {', '.join(AMPLITUDE_STARTS)}, got {start!r}")
    if start == "file" and sim.setup.F_grid is None:
        raise InputError("structure_factors: start 'file' needs an -hkl table in the model")
    if not min_photons >= 0:
        raise InputError(f"structure_factors: min_photons must be >= 0, got {min_photons!r}")
    _, group = _gemmi_group(space_group)
    restricted, overrides, lo, hi = touched_range(sim, values, pixels)
    grid = start_grid(sim, lo, hi, float(values["default_F"]))
    photons = _photons_per_entry(restricted, overrides, None, grid, lo, float(values.get("scale", 1.0)))
    table, grid = table_from_photons(group.hm, grid, lo, photons, values, start=start, min_photons=min_photons,
                                     anomalous=anomalous)
    return table, sim.with_structure_factors(grid, lo)


def touched_range(sim, values: Mapping[str, float], pixels) -> tuple:
    """``(sim restricted to the fitted pixels, overrides, lo, hi)``: the inclusive index bounds (with the margin)
    of the reflections the fitted ``pixels`` touch at ``values``; refused when too many for one table."""
    from nbtorch.parameters import ORIENTATION_DELTAS, PARAMETER_NAMES  # noqa: PLC0415 - keeps this module light

    mask = np.asarray(pixels.cpu() if isinstance(pixels, Tensor) else pixels, dtype=bool)
    restricted = sim.restricted(mask)
    overrides = {n: float(values[n]) for n in PARAMETER_NAMES + ORIENTATION_DELTAS}
    lo, hi = _touched_range(restricted, overrides, None)
    check_table_size(lo, hi)
    return restricted, overrides, lo, hi


def check_table_size(lo: np.ndarray, hi: np.ndarray) -> None:
    if np.prod(hi - lo + 1) > MAX_GRID_ELEMENTS:  # the HKL reader's limit on a dense table
        raise InputError(f"structure_factors: the fitted pixels touch indices {lo.tolist()} to {hi.tolist()}: "
                         f"too many reflections for one table")


def entry_photons(sim, values: Mapping[str, float], pixels, grid: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """(nh, nk, nl) Bragg photons (``scale x`` simulated) each entry of the table ``grid`` (indices from ``lo``)
    puts on the fitted ``pixels`` of ``sim`` at ``values``."""
    from nbtorch.parameters import ORIENTATION_DELTAS, PARAMETER_NAMES  # noqa: PLC0415 - keeps this module light

    mask = np.asarray(pixels.cpu() if isinstance(pixels, Tensor) else pixels, dtype=bool)
    overrides = {n: float(values[n]) for n in PARAMETER_NAMES + ORIENTATION_DELTAS}
    return _photons_per_entry(sim.restricted(mask), overrides, None, grid, lo, float(values.get("scale", 1.0)))


def table_from_photons(space_group: str, grid: np.ndarray, lo: np.ndarray, photons: np.ndarray,
                       values: Mapping[str, float], *, start: str, min_photons: float,
                       anomalous: bool = False) -> tuple[AmplitudeTable, np.ndarray]:
    """``(table, grid)``: the candidates (module docstring) of the entries' Bragg ``photons`` over the starting
    ``grid`` (indices from ``lo``; ``values``: the cell and ``default_F``), their starting amplitudes put in the
    grid (a copy) and the systematic absences set to 0."""
    gemmi, group = _gemmi_group(space_group)
    ops = group.operations()
    grid = np.array(grid, dtype=np.float64)
    hi = lo + np.array(grid.shape) - 1
    default_F = float(values["default_F"])
    asu = gemmi.ReciprocalAsu(group)
    rot = rotation_parts(gemmi, group)  # once: every reflection's equivalents below
    groups: dict[tuple, float] = {}  # (asu reflection, sign) -> photons
    for e in np.argwhere(photons > 1e-3 * _CANDIDATE_FRACTION * max(min_photons, 1e-9)):  # summed per reflection
        key, sign = asu_reflection(ops, asu, (e + lo).tolist(), anomalous)
        groups[key, sign] = groups.get((key, sign), 0.0) + float(photons[tuple(e)])
    index = np.full(grid.shape, -1, dtype=np.int64)
    # systematic absences: 0, never refined
    free = []
    for key, sign in sorted(groups):
        if ops.is_systematically_absent(list(key)):
            for eq in _equivalents(rot, np.array(key)):
                if np.all(eq >= lo) and np.all(eq <= hi):
                    grid[tuple(eq - lo)] = 0.0
        elif groups[key, sign] >= _CANDIDATE_FRACTION * min_photons and key != (0, 0, 0):  # F(000): the direct beam
            free.append((key, sign))
    _check_pairs(free, anomalous, group.hm)
    hkl = np.array([[s * x if s else x for x in key] for key, s in free], dtype=np.int64).reshape(-1, 3)
    starts = {}
    cell = gemmi.UnitCell(*(float(values[n]) for n in ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta",
                                                          "cell_gamma")))
    entries = [[eq for eq in _members(rot, h, s) if np.all(eq >= lo) and np.all(eq <= hi)]
               for h, (_, s) in zip(hkl, free)]
    if start == "one" and not default_F > 0:  # one value for all: the table's rms over the free reflections
        listed = [float(grid[tuple(e[0] - lo)]) for e in entries if e]
        default_F = math.sqrt(float(np.mean(np.square(listed)))) if listed else 1.0
    for i, (key, inside) in enumerate(zip(hkl, entries)):
        f0 = default_F if start == "one" or not inside else float(grid[tuple(inside[0] - lo)])
        f0 = f0 if f0 > 0 else max(default_F, 1.0)  # refined as F0 exp(raw): a start > 0
        for eq in inside:
            index[tuple(eq - lo)] = i
            grid[tuple(eq - lo)] = f0
        starts[amplitude_name(key)] = f0
    table = AmplitudeTable(
        space_group=group.hm, hkl_min=lo, start=grid, index=index, names=tuple(amplitude_name(k) for k in hkl),
        hkl=hkl, d_A=np.array([cell.calculate_d(list(k)) for k, _ in free], dtype=np.float64),
        photons=np.array([groups[k] for k in free], dtype=np.float64), starts=starts, start_mode=start,
        signs=np.array([s for _, s in free], dtype=np.int64))
    log.info("structure factors: %d candidate amplitudes (%d reflections touched) in %s",
             len(free), len(groups), group.hm)
    return table, grid


def _check_pairs(free: list, anomalous: bool, group: str) -> None:
    """Anomalous pairs need a reflection whose F(+) and F(-) are both candidates: else one error line."""
    if anomalous and not {k for k, s in free if s > 0} & {k for k, s in free if s < 0}:
        raise InputError(f"anomalous pairs asked without anomalous data to tell them apart: no acentric reflection "
                         f"of {group} has both Friedel mates among the {len(free)} candidates")


def estimate_amplitudes(objective, table: AmplitudeTable, values: Mapping[str, Tensor | float],
                        iterations: int = 5) -> dict[str, float]:
    """Amplitudes that explain the observed spots with the geometry of ``values`` fixed (module docstring).

    ``objective``: an :class:`~refine.fitting.objective.ImageObjective` that holds ``table``.  Each iteration is one
    multiplicative EM update of the intensities ``F^2`` of the Poisson likelihood (background in the model,
    never made negative); a reflection without signal on the objective's pixels keeps its value.
    """
    dtype, dev = objective.dtype, objective.device
    F = table.vector(values, dtype, dev).detach().clone()
    for _ in range(int(iterations)):
        F = em_update(F, *em_sums(objective, table, values, F))
    return {n: float(v) for n, v in zip(table.names, F)}


def em_sums(objective, table: AmplitudeTable, values: Mapping[str, Tensor | float], F: Tensor) -> tuple[Tensor, Tensor]:
    """``(c, a)`` of one EM update on the objective's pixels at amplitudes ``F``: ``c_r = sum_p w_p d mu_p / d F_r``
    and ``a_r = sum_p w_p y_p / mu_p d mu_p / d F_r`` (several images: summed over them, :mod:`refine.many.joint`)."""
    c = _weighted_gradient(objective, table, values, F, lambda mu, y, w: w)
    a = _weighted_gradient(objective, table, values, F, lambda mu, y, w: w * y / torch.clamp(mu, min=1e-12))
    return c, a


def em_update(F: Tensor, c: Tensor, a: Tensor) -> Tensor:
    """One multiplicative EM update of the intensities ``F^2``: ``F <- F sqrt(a / c)`` (the ratio clamped to
    [1e-4, 1e4]; an amplitude without signal, ``c`` ~ 0, keeps its value; none below 1e-6 of the largest)."""
    ok = c > 1e-12 * float(c.abs().max().clamp(min=1e-300))
    ratio = torch.where(ok, a / torch.where(ok, c, torch.ones_like(c)), torch.ones_like(c))
    F = F * torch.sqrt(ratio.clamp(1e-4, 1e4))
    return torch.clamp(F, min=1e-6 * float(F.max().clamp(min=1e-300)))


def amplitude_photons(objective, table: AmplitudeTable, values: Mapping[str, Tensor | float],
                      names: Sequence[str] | None = None) -> dict[str, float]:
    """Bragg photons (``scale x`` simulated) each amplitude of ``names`` (default all) puts on the objective's
    pixels at ``values``: ``F / 2 x d(sum of the model) / dF`` (the model is a sum of ``F^2`` terms)."""
    photons = amplitude_photon_vector(objective, table, values)
    wanted = set(table.names if names is None else names)
    return {n: float(p) for n, p in zip(table.names, photons) if n in wanted}


def amplitude_photon_vector(objective, table: AmplitudeTable, values: Mapping[str, Tensor | float]) -> Tensor:
    """(A,) :func:`amplitude_photons` of every amplitude in the table's order, as one tensor (no number per name:
    a joint run's pass over 10^4 stills makes no 10^4-entry dict per still)."""
    F = table.vector(values, objective.dtype, objective.device).detach()
    return 0.5 * F * _weighted_gradient(objective, table, values, F, lambda mu, y, w: w)


def _weighted_gradient(objective, table: AmplitudeTable, values: Mapping, F: Tensor, factor) -> Tensor:
    """``sum_p factor(mu, y, w)_p d mu_p / d F`` at amplitudes ``F`` (one forward and one backward: a compiled
    backward may run only once per graph)."""
    leaf = F.clone().requires_grad_(True)
    # the amplitudes as one block (AmplitudeTable.vector reads it as it is): no tensor per name, no copy of values
    vals = ChainMap({AMPLITUDE_BLOCK: (table.names, leaf)}, values)
    with torch.enable_grad():
        model, observed, weights = objective.pixels(vals)
        f = factor(model.detach(), observed, weights)
        return torch.autograd.grad(model, leaf, grad_outputs=f)[0]


@dataclass(frozen=True)
class AmplitudeOptions:
    """How a refinement treats the structure factors (module docstring).

    Attributes:
        space_group: full space-group symbol (``P41212``): equivalents and Friedel mates share one amplitude.
        start: ``auto``, ``file``, ``one`` or ``estimate``.
        min_photons: Bragg photons a reflection needs on the fitted pixels to be refined.
        restraint_sigma: relative width of the restraint towards the resolution-bin mean (None: none).
        iterations: EM updates of the ``estimate`` start.
        anomalous: F(+) and F(-) refined apart (refused in a centrosymmetric space group).
        anomalous_sigma: relative width of the restraint of each pair's difference (None: none).
        information: how a joint run treats the amplitudes' information: ``dense`` (every still's block over all
            names), ``diagonal`` (each amplitude by its own diagonal: thousands of amplitudes and stills;
            :mod:`refine.many.sparse_amplitudes`) or ``auto`` (diagonal above 64 refined amplitudes, when the model
            does not interpolate the structure factors).
    """

    space_group: str
    start: str = "auto"
    min_photons: float = DEFAULT_MIN_PHOTONS
    restraint_sigma: float | None = None
    iterations: int = 5
    anomalous: bool = False
    anomalous_sigma: float | None = None
    information: str = "auto"

    def __post_init__(self) -> None:
        if self.information not in ("auto", "dense", "diagonal"):
            raise InputError(f"structure_factors: information must be one of auto, dense, diagonal, "
                             f"got {self.information!r}")
        if self.start not in AMPLITUDE_STARTS:
            raise InputError(f"structure_factors: start must be one of {', '.join(AMPLITUDE_STARTS)}, "
                             f"got {self.start!r}")
        if self.restraint_sigma is not None and not (math.isfinite(self.restraint_sigma) and self.restraint_sigma > 0):
            raise InputError(f"structure_factors: restraint sigma must be > 0, got {self.restraint_sigma!r}")
        if not (math.isfinite(self.min_photons) and self.min_photons >= 0):
            raise InputError(f"structure_factors: min_photons must be >= 0, got {self.min_photons!r}")
        if int(self.iterations) != self.iterations or self.iterations < 0:
            raise InputError(f"structure_factors: iterations must be an integer >= 0, got {self.iterations!r}")
        if self.anomalous_sigma is not None and not self.anomalous:
            raise InputError("structure_factors: an anomalous restraint needs anomalous pairs (anomalous=True)")
        if self.anomalous_sigma is not None and not (math.isfinite(self.anomalous_sigma) and self.anomalous_sigma > 0):
            raise InputError(f"structure_factors: anomalous restraint sigma must be > 0, got {self.anomalous_sigma!r}")
        if self.anomalous and _gemmi_group(self.space_group)[1].is_centrosymmetric():
            raise InputError(f"structure_factors: anomalous pairs asked in the centrosymmetric space group "
                             f"{self.space_group}, where every Friedel mate is a symmetry equivalent")

    def restraint(self, table: AmplitudeTable) -> AmplitudeRestraint | None:
        """The run's restraint of ``table`` (None without a sigma or without candidates)."""
        if not table.names or (self.restraint_sigma is None and self.anomalous_sigma is None):
            return None
        return AmplitudeRestraint(table, self.restraint_sigma, anomalous_sigma=self.anomalous_sigma)

    def describe(self) -> dict:
        anomalous = {"anomalous": True, "anomalous_sigma": self.anomalous_sigma or 0.0} if self.anomalous else {}
        information = {} if self.information == "auto" else {"information": self.information}
        return {"space_group": self.space_group, "start": self.start, "min_photons": self.min_photons,
                "restraint_sigma": self.restraint_sigma or 0.0, "iterations": self.iterations, **anomalous,
                **information}
