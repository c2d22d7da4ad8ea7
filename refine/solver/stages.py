"""Staged refinement: which groups each stage frees, how it sees the image, and which step rule it uses.

A :class:`Stage` frees a set of groups or names (:mod:`refine.fitting.parameters`) and
runs the loop (:mod:`refine.solver.loop`) with its own strategy and stopping rules on
its own :class:`~refine.fitting.objective.View` of the image:

* ``roi_fraction``: fit only the disc of pixels within this fraction of the
  distance from the direct beam to the farthest corner (low-resolution pixels
  first: a cell error moves a spot in proportion to its distance from the beam);
* ``bin``: sum model and observed over ``bin x bin`` blocks (capture range x ``bin``);
* ``n_factor``: simulate ``N * n_factor`` unit cells (spots ``1 / n_factor`` times
  wider) while ``N`` is not refined.

Why coarse-to-fine: a 0.5-1 % cell error (or a 2-pixel beam-centre error)
moves high-order spots by more than their width; there the model and observed
spots do not overlap, the loss is flat and its gradient vanishes.  Broad,
binned, low-resolution views overlap from such starts, and each later stage
starts inside the basin of the sharper one.

:func:`stage_a` is the default schedule (each stage keeps the groups of the
previous ones free):

=============  ==============================================  ===  ===========
stage          frees                                           bin  disc radius
=============  ==============================================  ===  ===========
beam_centre    scale, background, beam_x, beam_y               8    128 px
orientation    + orientation                                   8    64 px
cell           + cell                                          4    128 px
detector       + distance                                      2    all
mosaic         + mosaic_spread, N                              1    all
final          everything above, tight tolerances              1    all
=============  ==============================================  ===  ===========

The beam centre is refined first, alone (with scale and background), on a
wide disc: a beam-centre error is a rigid translation of the whole pattern,
which no crystal rotation can absorb, so fitting the orientation without it
drives the crystal to a wrong orientation; and fitted together with the
orientation on the small disc only, the two can trade against each other
(on the hexagonal 512 x 512 problem of the bank, a 2-pixel error grew to 2.5
pixels and the orientation error from 0.3 to 0.8 deg, a false minimum no
later stage left).  A translation is seen by every spot, so the wide disc
fixes it to a fraction of a pixel whatever the orientation error; the
orientation stage then keeps it free.  Binning is the main coarse view: the image binned by 8 has a
capture range of several pixels.  The disc of low-resolution pixels is
capped in pixels (``roi_radius``), not as a fraction of the detector: on a
64 x 64 detector it is the whole image (a smaller disc holds too few spots
to fix the orientation), on a 512 x 512 one it keeps the first stages away
from the high-angle spots, whose partialities change with the orientation
faster than the coarse stages can follow, and it makes them 16x cheaper.  Spot
broadening (``n_factor``) is available but not used by default: a broadened
model fits the sharp observed spots with a biased cell.

With LBFGS every stage is preconditioned with the Fisher matrix of its view
(``precondition="full"``, :mod:`refine.solver.precondition`): the stage then starts with
the Gauss-Newton curvature, and the final stage converges in a handful of steps.
Adam stages are not preconditioned (Adam normalises each coordinate itself,
and in units of one standard deviation a parameter that must travel far,
such as N, would need hundreds of steps).

Groups a run holds fixed (``fixed=``) are removed from every stage; a stage
left with nothing to refine is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from nbtorch.errors import InputError
from refine.solver.loop import Convergence
from refine.solver.precondition import PRECONDITIONERS
from refine.solver.strategies import AbstractStrategy, Adam, LBFGS, get_strategy

__all__ = ["Stage", "stage_a", "single_stage", "coarse_to_fine", "with_amplitudes", "MEASURED_DETECTOR", "COARSE_FTOL",
           "COARSE_XTOL"]


@dataclass(frozen=True)
class Stage:
    """One stage of a refinement.

    Arguments:
        name: label (history, TensorBoard, result files).
        free: groups and/or names refined in this stage.
        strategy: step rule (:class:`~refine.solver.strategies.LBFGS` or :class:`~refine.solver.strategies.Adam`).
        convergence: stopping rules (:class:`~refine.solver.loop.Convergence`).
        roi_fraction: radius of the fitted disc around the beam, as a fraction of the
            beam-to-farthest-corner distance (1 = the whole image).
        bin: binning factor (1 = none).
        n_factor: spot broadening, ``N * n_factor`` simulated (1 = none; only while N is fixed).
        precondition: ``None``, ``"diagonal"`` or ``"full"``: rescale/whiten the raw parameters
            with the Fisher matrix of this stage's view at its start (:mod:`refine.solver.precondition`).
        roi_radius: cap on the fitted disc's radius in pixels (None = no cap): the low-resolution
            pixels of a large detector, whatever its size.
    """

    name: str
    free: tuple[str, ...]
    strategy: AbstractStrategy = field(default_factory=LBFGS)
    convergence: Convergence = field(default_factory=Convergence)
    roi_fraction: float = 1.0
    bin: int = 1
    n_factor: float = 1.0
    precondition: str | None = None
    roi_radius: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.free, str):
            object.__setattr__(self, "free", (self.free,))
        object.__setattr__(self, "free", tuple(self.free))
        if self.roi_radius is not None and not self.roi_radius > 0:
            raise InputError(f"stage {self.name}: roi_radius must be > 0 pixels, got {self.roi_radius!r}")
        if not self.roi_fraction > 0:
            raise InputError(f"stage {self.name}: roi_fraction must be > 0, got {self.roi_fraction!r}")
        if int(self.bin) != self.bin or self.bin < 1:
            raise InputError(f"stage {self.name}: bin must be an integer >= 1, got {self.bin!r}")
        if not 0 < self.n_factor <= 1:
            raise InputError(f"stage {self.name}: n_factor must be in (0, 1], got {self.n_factor!r}")
        if self.precondition not in PRECONDITIONERS:
            raise InputError(f"stage {self.name}: precondition must be None, 'diagonal' or 'full', "
                             f"got {self.precondition!r}")

    @property
    def coarse(self) -> bool:
        return self.roi_fraction < 1 or self.roi_radius is not None or self.bin > 1 or self.n_factor < 1

    def describe(self) -> dict:
        """Flat settings (for histories and result files)."""
        return {"name": self.name, "free": list(self.free), "strategy": self.strategy.hparams(),
                "max_steps": self.convergence.max_steps, "roi_fraction": self.roi_fraction, "bin": self.bin,
                "n_factor": self.n_factor, "precondition": self.precondition or "none",
                "roi_radius": self.roi_radius if self.roi_radius is not None else 0.0}


#: what the ``detector`` stage of :func:`stage_a` frees for a measured image: the distance (fixed by default for one
#: image: ``nbtorch-refine`` fixes it unless ``--fix`` says otherwise) and the detector's tilt
MEASURED_DETECTOR = ("distance", "detector_rotx", "detector_roty")


def stage_a(strategy: str | AbstractStrategy | None = None, max_steps: int | None = None,
            final_steps: int | None = None, coarse: bool = True,
            precondition: str | None | bool = True, detector: tuple[str, ...] = ("distance",)) -> tuple[Stage, ...]:
    """The default schedule (module docstring): orientation and beam centre, then cell, detector, mosaic and N.

    Arguments:
        strategy: ``"lbfgs"`` (default), ``"adam"`` or a strategy object for every stage.
        max_steps: steps per coarse stage (default 25 for LBFGS, 100 for Adam).
        final_steps: steps of the final stage (default 5 x ``max_steps`` when that is given, else 150 for
            LBFGS, 400 for Adam).
        coarse: use the binned views (False: every stage on the full image).
        precondition: True = the strategy's default (``"full"`` Fisher whitening for LBFGS,
            none for Adam, whose per-parameter step normalisation works best in the
            transforms' own units); or None / ``"diagonal"`` / ``"full"``.
        detector: the names the ``detector`` stage frees (:data:`MEASURED_DETECTOR` for a measured image: the
            tilt too, where the spots can decide it: :func:`refine.quality.identifiability.reduce_free`).
    """
    strat = get_strategy(strategy)
    adam = isinstance(strat, Adam)
    n = max_steps if max_steps is not None else (100 if adam else 25)
    if final_steps is not None:
        nf = final_steps
    else:
        nf = 5 * max_steps if max_steps is not None else (400 if adam else 150)
    pre = (None if adam else "full") if precondition is True else (precondition or None)
    loose = Convergence(max_steps=n, ftol=1e-2, rtol=1e-6 if adam else 1e-5, xtol=1e-3 if adam else 1e-2)
    final = Convergence(max_steps=nf, ftol=1e-4, xtol=1e-4)
    groups = [
        ("beam_centre", ("scale", "background", "beam_x", "beam_y"), 8, 128.0),
        ("orientation", ("orientation",), 8, 64.0),
        ("cell", ("cell",), 4, 128.0),
        ("detector", tuple(detector), 2, None),
        ("mosaic", ("mosaic",), 1, None),
    ]
    stages = []
    free: tuple[str, ...] = ()
    for name, add, b, radius in groups:
        free = free + add
        if coarse:
            stages.append(Stage(name, free, strat, loose, 1.0, b, 1.0, pre, radius))
        else:
            stages.append(Stage(name, free, strat, loose, precondition=pre))
    stages.append(Stage("final", free, strat, final, precondition=pre))
    return tuple(stages)


def single_stage(free: tuple[str, ...] | list[str], strategy: str | AbstractStrategy | None = None,
                 convergence: Convergence | None = None) -> tuple[Stage, ...]:
    """One stage on the full image freeing ``free`` (no coarse-to-fine)."""
    return (Stage("all", tuple(free), get_strategy(strategy), convergence or Convergence(max_steps=200)),)


#: loss change (in the loss's units: for the Poisson half deviance 0.1 is a change of about 0.45 esd along
#: one direction) and raw-parameter change (0.1 of a typical step; 0.1 pixel of the beam centre, against the
#: 2- or 4-pixel bins of the coarse views) below which a coarse copy of :func:`coarse_to_fine` has done its
#: job; the full-image stage after it refines to its own tolerances.  (1e-3 until 2026-11: the same refined
#: values to every printed digit on the README's main job, 36 of its 185 steps fewer.)
COARSE_FTOL = 0.1
COARSE_XTOL = 0.1


def coarse_to_fine(stage: Stage, levels: tuple[tuple[float, int, float], ...] = ((0.5, 4, 1.0), (0.75, 2, 1.0))) -> tuple[Stage, ...]:
    """``stage`` preceded by coarse copies of itself, one per ``(roi_fraction, bin, n_factor)`` level.

    The coarse copies only have to bring the model into the full image's basin, so they stop at loose
    tolerances (:data:`COARSE_FTOL`, :data:`COARSE_XTOL`); each copy and the stage start from the LBFGS
    memory of the copy before (:mod:`refine.solver.runner`: same names, no preconditioning); ``n_factor`` only
    applies while N is fixed.
    """
    out = []
    for i, (frac, b, nf) in enumerate(levels):
        conv = stage.convergence.replace(ftol=max(stage.convergence.ftol, COARSE_FTOL),
                                         xtol=max(stage.convergence.xtol, COARSE_XTOL))
        out.append(replace(stage, name=f"{stage.name}-coarse{i + 1}", convergence=conv, roi_fraction=frac, bin=b, n_factor=nf))
    return tuple(out) + (stage,)


def with_amplitudes(stages: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """``stages`` followed by a stage ``amplitudes`` that refines the structure factors together with what the
    last stage refines but ``scale`` (same strategy, stopping rules and view): the geometry first, then both.
    The scale is held: it multiplies every ``F^2``, so with the visible amplitudes free it is only decided by
    the few photons of the reflections too weak to be refined."""
    last = stages[-1]
    free = tuple(n for n in last.free if n != "scale") + ("structure_factors",)
    return tuple(stages) + (replace(last, name="amplitudes", free=free),)
