"""What the experiments refine: a problem of the bank (known truth) or a measured image and a model.

:func:`load_workload` returns a :class:`Workload`; ``workload.simulator(compile=...)``
builds a fresh simulator of the starting model, ``workload.refine_kwargs()`` the
arguments of :func:`refine.refine` after the simulator and the image.
:func:`parameter_error` measures how far a set of parameters is from the truth
as the RMS of the errors left, each relative to the start's error (1 = no
progress, 0 = the truth); the orientation counts once, as the misorientation angle.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from nbtorch import Simulator, config_from_args
from nbtorch.errors import InputError
from nbtorch.resolve import resolve
from refine import make_problem
from refine.inputs.images import load_image
from refine.inputs.problems import misorientation_deg

__all__ = ["Workload", "load_workload", "parameter_error", "DTYPES"]

DTYPES = {"float64": torch.float64, "float32": torch.float32}
#: names whose error counts in :func:`parameter_error` (besides the misorientation)
ERROR_NAMES = ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta", "cell_gamma", "beam_x", "beam_y",
               "distance", "mosaic_spread", "N_a", "N_b", "N_c", "scale")


@dataclass(frozen=True)
class Workload:
    """One refinement input.

    Attributes:
        label: problem name or image path.
        args: nanoBragg flags of the starting model (tokens).
        observed: (slow, fast) float64 observed photons.
        start: starting base values (may be empty: the simulator's own values).
        truth: base values at the truth, or None (a measured image).
        symmetry, free, fixed: as for :func:`refine.refine`.
        dtype, device: of the simulators built.
    """

    label: str
    args: tuple[str, ...]
    observed: np.ndarray = field(repr=False)
    start: dict = field(repr=False)
    truth: dict | None = field(repr=False)
    symmetry: str
    free: tuple[str, ...]
    fixed: tuple[str, ...]
    dtype: torch.dtype = torch.float64
    device: str = "cpu"

    def simulator(self, compile: bool | None = False) -> Simulator:
        """A simulator of the starting model (``compile=None``: the environment decides)."""
        return Simulator(config_from_args(list(self.args)), dtype=self.dtype, device=self.device, compile=compile)

    def refine_kwargs(self) -> dict:
        return {"start": dict(self.start), "symmetry": self.symmetry, "free": self.free, "fixed": self.fixed}


def load_workload(problem: str = "cubic_mosflm", size: int = 32, image: str | None = None, model: str | None = None,
                  symmetry: str | None = None, dtype: str = "float64", device: str = "cpu") -> Workload:
    """A bank problem (``problem``, ``size``), or ``image`` + ``model`` (nanoBragg flags) without truth.

    Bad input (an unknown problem, a size too small, a missing or unreadable image, bad model
    flags, an image whose shape is not the model's detector) raises :class:`InputError` before
    anything is simulated.
    """
    if image is not None or model is not None:
        if image is None or model is None:
            raise InputError("--image and --model go together: give both (or neither, for a --problem)")
        try:
            tokens = tuple(shlex.split(model))
        except ValueError as exc:
            raise InputError(f"--model {model!r}: {exc}") from None
        if not tokens:
            raise InputError("--model: empty; give the starting model's nanoBragg flags")
        setup = resolve(config_from_args(list(tokens)))  # the model checked (and its detector) before the image
        measured = load_image(image)
        obs = np.asarray(measured.image, dtype=np.float64)
        if obs.ndim != 2 or obs.shape != (setup.spixels, setup.fpixels):
            got = " x ".join(map(str, obs.shape[::-1]))
            raise InputError(f"--image {image}: image is {got} pixels (fast x slow) but the --model detector is "
                             f"{setup.fpixels} x {setup.spixels}; fix -detpixels_f/-detpixels_s (or -detpixels) "
                             f"in --model")
        return Workload(label=str(image), args=tokens, observed=obs, start={}, truth=None,
                        symmetry=symmetry or "triclinic",
                        free=("scale", "background", "orientation", "cell", "beam_centre", "mosaic"),
                        fixed=("distance",), dtype=DTYPES[dtype], device=device)
    p = make_problem(problem, size=size, option_prefix="--")
    return Workload(label=f"{problem} ({size}x{size})", args=p.args, observed=p.observed, start=dict(p.start),
                    truth=dict(p.truth), symmetry=symmetry or p.symmetry, free=p.free, fixed=p.fixed,
                    dtype=DTYPES[dtype], device=device)


def parameter_error(values: Mapping[str, float], start: Mapping[str, float], truth: Mapping[str, float]) -> float:
    """RMS over the perturbed names of ``(value - truth) / (start - truth)``, misorientation included."""
    terms = []
    for n in ERROR_NAMES:
        if n in values and n in truth and n in start:
            d0 = float(start[n]) - float(truth[n])
            if abs(d0) > 1e-9 * max(1.0, abs(float(truth[n]))):
                terms.append((float(values[n]) - float(truth[n])) / d0)
    keys = ("misset_x", "misset_y", "misset_z")
    if all(k in values and k in truth and k in start for k in keys):
        m0 = misorientation_deg([start[k] for k in keys], [truth[k] for k in keys])
        if m0 > 1e-9:
            terms.append(misorientation_deg([values[k] for k in keys], [truth[k] for k in keys]) / m0)
    return math.sqrt(sum(t * t for t in terms) / len(terms)) if terms else float("nan")
