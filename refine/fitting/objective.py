"""The image model and loss one refinement stage fits: which pixels, how binned, how broadened.

Image model (photons per pixel, rows slow, columns fast)::

    model = scale * simulator(**overrides) + background [+ background_x * (x - xc) + background_y * (y - yc)]

with ``x, y`` the fast and slow pixel indices and ``xc, yc`` the image centre.
A stage fits a :class:`View` of the detector: a rectangle (inclusive pixel
bounds, as ``Simulator.render``'s ``roi``), a boolean mask inside it (the
user's mask, finite non-negative observed pixels, and for a coarse stage the
disc of low-resolution pixels around the direct beam), and a binning factor
``bin``: model and observed are summed over ``bin x bin`` blocks of valid
pixels, which keeps Poisson statistics exact and widens the capture range by
``bin``.  ``n_factor < 1`` broadens every spot by simulating ``N * n_factor``
unit cells (coarse stages only, while N is not refined).

The default loss is the half Poisson deviance (``sum w (model - k + k log(k / model))``,
:func:`losses.kernels.poisson_deviance`, re-exported here): its gradient is that of the Poisson
negative log-likelihood, it is 0 for a perfect fit and about half the number of
pixels for a correct model with Poisson noise, and a change of 0.5 is one
standard deviation of a single parameter.  Every loss comes from :mod:`losses` by its
registry name, through its check-free kernel: pure tensor functions with no
data-dependent Python branches, so ``torch.compile(fullgraph=True)`` accepts them.

Unbinned views with a pixelwise loss (``poisson_deviance``, every
:func:`losses.get_loss` name through :func:`resolve_loss`, or any callable with
``pixelwise = True``: its value is a sum over pixels that ignores zero-weight
ones) are evaluated sparsely: the simulator computes only the fitted pixels
(:meth:`Simulator.render_pixels`) and the model and loss are vectors over those
pixels, never images of the whole rectangle.  A real still fitted on 1 % of a
1200 x 1200 rectangle costs what its 82 000 pixels cost, not 1.4 million.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from losses.kernels import PIXEL_TERMS, gaussian_restraint_terms, poisson_deviance
from losses.registry import LOSSES, get_loss
from nbtorch.runtime import policy as runtime
from nbtorch.errors import InputError
from nbtorch.parameters import PARAMETER_NAMES, SIZE_DIAGONAL, SIZE_OFF_DIAGONAL
from refine.fitting.parameters import BASE_NAMES
from nbtorch.simulator import ORIENTATION_DELTAS, Simulator

__all__ = ["poisson_deviance", "View", "make_view", "beam_pixel", "ImageObjective", "LossFn", "resolve_loss",
           "check_priors"]

LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (model, observed, weights) -> scalar


def check_priors(priors: Mapping[str, tuple[float, float]] | None, what: str = "priors") -> dict[str, tuple[float, float]]:
    """``name -> (mean, sigma)`` checked: a refinable base name (:data:`refine.fitting.parameters.BASE_NAMES`, in its own
    units), a finite mean and a finite sigma > 0; one-line errors naming ``what``."""
    out: dict[str, tuple[float, float]] = {}
    for name, pair in (priors or {}).items():
        if name not in BASE_NAMES:
            raise InputError(f"{what}: unknown parameter {name!r}; valid: {', '.join(BASE_NAMES)}")
        try:
            mean, sigma = (float(v) for v in pair)
        except (TypeError, ValueError):
            raise InputError(f"{what} {name}: expected (mean, sigma), got {pair!r}") from None
        if not math.isfinite(mean):
            raise InputError(f"{what} {name}: the mean must be finite, got {mean:g}")
        if not (math.isfinite(sigma) and sigma > 0):
            raise InputError(f"{what} {name}: sigma must be finite and > 0, got {sigma:g}")
        out[name] = (mean, sigma)
    return out


def resolve_loss(loss: str | LossFn) -> LossFn:
    """The loss as ``(model, observed, weights) -> scalar``: ``"poisson"`` (default, the half Poisson deviance
    :func:`losses.kernels.poisson_deviance`), another registry name (:data:`losses.LOSSES`, the same meaning as
    :func:`losses.get_loss`; summed over the fitted pixels through its check-free kernel, or the module for the
    non-pixelwise ``ncc``), or a callable."""
    if callable(loss):
        return loss
    if loss == "poisson":
        return poisson_deviance
    if loss not in LOSSES:
        raise InputError(f"loss: unknown loss {loss!r}; valid: {', '.join(LOSSES)}")
    if loss in PIXEL_TERMS:
        terms = PIXEL_TERMS[loss]

        def fn(model: Tensor, observed: Tensor, weights: Tensor) -> Tensor:
            k = torch.where(weights > 0, observed, model.detach())  # ignored pixels: a harmless finite value
            return (weights * terms(model, k)).sum()
    else:
        module = get_loss(loss, reduction="sum")

        def fn(model: Tensor, observed: Tensor, weights: Tensor) -> Tensor:
            return module(model, observed, mask=weights > 0)

    fn.__name__ = f"{loss}_sum"
    fn.pixelwise = True  # every registry loss sums over (unmasked) pixels, in any shape
    return fn


@dataclass(frozen=True)
class View:
    """The pixels a stage fits.

    Attributes:
        roi: (x0, x1, y0, y1) inclusive fast/slow pixel bounds; both sizes are multiples of ``bin``.
        mask: bool (y1 - y0 + 1, x1 - x0 + 1), True = pixel used; None for an objective on
            :class:`~refine.many.pixel_table.FittedPixels` (:meth:`ImageObjective.from_pixels`), which holds the
            used positions instead.
        bin: binning factor.
        fraction: radius of the fitted disc as a fraction of the beam-to-farthest-corner distance (1 = all).
    """

    roi: tuple[int, int, int, int]
    mask: Tensor | None
    bin: int = 1
    fraction: float = 1.0

    @property
    def shape(self) -> tuple[int, int]:
        x0, x1, y0, y1 = self.roi
        return (y1 - y0 + 1, x1 - x0 + 1)

    @property
    def binned_shape(self) -> tuple[int, int]:
        return (self.shape[0] // self.bin, self.shape[1] // self.bin)

    def crop(self, image: Tensor) -> Tensor:
        """The ROI of a full (slow, fast) image."""
        x0, x1, y0, y1 = self.roi
        return image[..., y0:y1 + 1, x0:x1 + 1]

    def pool(self, roi_image: Tensor) -> Tensor:
        """Sum of valid pixels over ``bin x bin`` blocks: (h, w) -> (h / bin, w / bin)."""
        x = roi_image if self.mask is None else torch.where(
            self.mask, roi_image, torch.zeros((), dtype=roi_image.dtype, device=roi_image.device))
        if self.bin == 1:
            return x
        return F.avg_pool2d(x[None, None], self.bin)[0, 0] * float(self.bin * self.bin)

    def weights(self, dtype: torch.dtype) -> Tensor:
        """1 for bins with at least one valid pixel, else 0 (binned shape)."""
        return (self.pool(self.mask.to(dtype)) > 0).to(dtype)


def beam_pixel(sim: Simulator, values: Mapping[str, float]) -> tuple[float, float]:
    """(fast, slow) pixel coordinates of the direct beam for ``values`` (pixel centres at integers; a multi-panel
    detector: in panel 0's pixels, i.e. in the stacked image)."""
    with torch.no_grad():
        names = PARAMETER_NAMES + (sim.panel_layout.names() if sim.panel_layout is not None else ())
        p = sim.parameters_dict(**{n: float(values[n]) for n in names if n in values})
        geom = sim.geometry(p, panel=0 if sim.panel_layout is not None else None)
        pix = sim.setup.pixel_m
        return float(geom.Fbeam) / pix - 0.5, float(geom.Sbeam) / pix - 0.5


def _reaching_usable(mask: Tensor, roi, bx: float, by: float, radius: float) -> float:
    """``radius``, or where the disc around the beam ``(bx, by)`` holds no usable pixel of ``mask`` (a detector
    swung away from the beam, spot windows far from it), the distance to the nearest usable pixel plus
    ``radius``: the disc then reaches as far past the nearest fitted pixels as it would have from the beam."""
    X0, X1, Y0, Y1 = roi
    ys, xs = torch.nonzero(mask[Y0:Y1 + 1, X0:X1 + 1], as_tuple=True)
    if ys.numel() == 0:
        return radius
    near = float(torch.sqrt(((xs.double() + X0 - bx) ** 2 + (ys.double() + Y0 - by) ** 2).min()))
    return radius if near <= radius else near + radius


def make_view(sim: Simulator, values: Mapping[str, float], mask: Tensor, fraction: float = 1.0, bin: int = 1,
              radius_px: float | None = None) -> View:
    """The :class:`View` of a stage: the disc around the beam of radius ``min(fraction * r_max, radius_px)``, binned.

    Arguments:
        sim: the simulator (its ROI bounds every view).
        values: current state (for the beam position).
        mask: bool (slow, fast), True = usable pixel (user mask and valid observed values).
        fraction: disc radius as a fraction of ``r_max``, the distance from the beam to the farthest
            image corner (>= 1: no limit).
        bin: binning factor (>= 1).
        radius_px: cap on the disc radius in pixels (None: no cap).

    A disc without a usable pixel grows by the distance to the nearest one (:func:`_reaching_usable`).
    """
    if int(bin) != bin or bin < 1:
        raise InputError(f"bin: expected an integer >= 1, got {bin!r}")
    bin = int(bin)
    if not fraction > 0:
        raise InputError(f"roi_fraction: must be > 0, got {fraction!r}")
    X0, X1, Y0, Y1 = sim.setup.roi
    x0, x1, y0, y1 = X0, X1, Y0, Y1
    ny, nx = sim.shape
    bx, by = beam_pixel(sim, values)
    corners = [(0.0, 0.0), (nx - 1.0, 0.0), (0.0, ny - 1.0), (nx - 1.0, ny - 1.0)]
    r_max = max(math.hypot(cx - bx, cy - by) for cx, cy in corners)
    radius = fraction * r_max
    if radius_px is not None:
        if not radius_px > 0:
            raise InputError(f"roi_radius: must be > 0 pixels, got {radius_px!r}")
        radius = min(radius, float(radius_px))
    radius = _reaching_usable(mask, sim.setup.roi, bx, by, radius)
    limited = radius < r_max
    fraction = min(1.0, radius / r_max)
    if limited:
        x0, x1 = max(X0, math.floor(bx - radius)), min(X1, math.ceil(bx + radius))
        y0, y1 = max(Y0, math.floor(by - radius)), min(Y1, math.ceil(by + radius))
    # trim to whole bins, symmetrically
    w, h = x1 - x0 + 1, y1 - y0 + 1
    dw, dh = w % bin, h % bin
    x0, x1 = x0 + dw // 2, x1 - (dw - dw // 2)
    y0, y1 = y0 + dh // 2, y1 - (dh - dh // 2)
    if x1 < x0 or y1 < y0:
        raise InputError(f"view: no pixels left for roi_fraction={fraction} and bin={bin}")
    m = mask[y0:y1 + 1, x0:x1 + 1].clone()
    if limited:
        ys = torch.arange(y0, y1 + 1, dtype=torch.float64)[:, None]
        xs = torch.arange(x0, x1 + 1, dtype=torch.float64)[None, :]
        m &= ((xs - bx) ** 2 + (ys - by) ** 2 <= radius * radius).to(m.device)
    if not bool(m.any()):
        raise InputError(f"view: every pixel is masked for roi_fraction={fraction} and bin={bin}")
    return View(roi=(x0, x1, y0, y1), mask=m, bin=bin, fraction=float(fraction))


class ImageObjective:
    """``values -> (loss, binned model)`` for one view of the observed image.

    Arguments:
        sim: the simulator.
        observed: (slow, fast) observed photons (same dtype/device as ``sim``).
        view: the :class:`View` to fit.
        loss: ``(model, observed, weights) -> scalar`` (e.g. :func:`poisson_deviance`).
        n_factor: simulate ``N * n_factor`` (spot broadening; 1 = none).
        compile_loss: wrap ``loss`` in ``torch.compile(fullgraph=True)`` (:func:`nbtorch.runtime.policy.compiled`).
        priors: name -> (mean, sigma), Gaussian restraints added to the loss.
        amplitudes: the run's :class:`~refine.fitting.structure_factors.AmplitudeTable` (the simulator must hold its
            table): the values' ``F_h_k_l`` are put into the structure-factor table of every evaluation.
        restraint: an :class:`~refine.fitting.structure_factors.AmplitudeRestraint` added to the loss.
        background_model: a :class:`~refine.fitting.background.BackgroundModel` (``resolution:K``, ``planes``)
            whose ``B`` replaces the flat ``background`` (None: the flat or planar background).

    With ``view.bin == 1`` and a pixelwise ``loss`` (see the module docstring) the loss
    is evaluated on the fitted pixels only (``sparse`` is True).  ``observed`` and
    ``weights`` are the view's images either way (``pixel_weights``: those of the
    fitted pixels, when sparse); :meth:`evaluate` gives the loss and a cheap stand-in
    for the model that :meth:`model_image` turns into the image.
    """

    def __init__(self, sim: Simulator, observed: Tensor, view: View, loss: LossFn = poisson_deviance,
                 n_factor: float = 1.0, compile_loss: bool = False,
                 priors: Mapping[str, tuple[float, float]] | None = None, amplitudes=None,
                 restraint=None, background_model=None) -> None:
        self.sim = sim
        self.background_model = background_model
        self.amplitudes = amplitudes
        self.restraint = restraint
        self.priors = check_priors(priors)
        self.view = view
        self.n_factor = float(n_factor)
        self.observed_full = observed
        self.observed = view.pool(view.crop(observed))
        self.weights = view.weights(observed.dtype)
        self.loss = loss
        self.sparse = view.bin == 1 and bool(getattr(loss, "pixelwise", False))
        self.loss_fn = runtime.compiled(loss, fullgraph=True) if compile_loss else loss
        ny, nx = sim.shape
        x0, x1, y0, y1 = view.roi
        dt, dev = observed.dtype, observed.device
        self._dx = (torch.arange(x0, x1 + 1, dtype=dt, device=dev) - (nx - 1) / 2.0)[None, :]
        self._dy = (torch.arange(y0, y1 + 1, dtype=dt, device=dev) - (ny - 1) / 2.0)[:, None]
        if self.sparse:
            self._init_pixels()

    def _init_pixels(self) -> None:
        """Index tables of the sparse path: the fitted pixels in the ROI and in the simulator's vector."""
        shape = self.view.shape
        dev = self.observed.device
        used = torch.nonzero(self.view.mask.reshape(-1)).reshape(-1).to(dev)  # flat positions in the ROI
        simulated = self.sim.simulated_pixels(self.view.roi)  # None = every ROI pixel, in order
        if simulated is None:
            gather, n = used, shape[0] * shape[1]
        else:
            simulated = simulated.to(dev)
            n = simulated.numel()
            pos = torch.searchsorted(simulated, used).clamp(max=max(n - 1, 0))
            hit = simulated[pos] == used if n else torch.zeros_like(used, dtype=torch.bool)
            gather = torch.where(hit, pos, n)  # a pixel the simulator masks reads the 0 appended at n
        self._used = used
        self._gather = gather
        # the simulator's vector is exactly the fitted pixels (a CLI run restricts it to them): no gather
        self._identity = gather.numel() == n and bool(torch.equal(gather, torch.arange(n, device=dev)))
        self._obs_px = self.observed.reshape(-1)[used]
        self.pixel_weights = torch.ones_like(self._obs_px)
        self._positions = False  # the simulator's own pixels (not render_pixels(pixels=...))

    @classmethod
    def from_pixels(cls, sim: Simulator, pixels, loss: LossFn = poisson_deviance, amplitudes=None,
                    restraint=None) -> "ImageObjective":
        """The sparse objective of an image's fitted pixels only (:class:`~refine.many.pixel_table.FittedPixels`):
        it holds their positions and photons and nothing of the detector's size (no observed image, no mask,
        no restricted simulator: :meth:`nbtorch.Simulator.render_pixels` computes the positions), the form a
        refinement of many images keeps per image (:mod:`refine.many.joint`).  The view is the simulator's ROI
        (the fitted pixels outside it are left out), unbinned; ``loss`` must be pixelwise."""
        if not getattr(loss, "pixelwise", False):
            raise InputError("from_pixels: the loss must be pixelwise (a sum over pixels; see resolve_loss)")
        pixels = pixels.to(sim.dtype, sim.device)
        if tuple(pixels.shape) != tuple(sim.shape):
            raise InputError(f"{pixels.source or 'fitted pixels'}: shape {tuple(pixels.shape)} does not match the "
                             f"detector {tuple(sim.shape)} (slow, fast)")
        roi = tuple(int(v) for v in sim.setup.roi)
        used, observed = pixels.in_roi(roi)
        if used.numel() == 0:
            raise InputError(f"{pixels.source or 'fitted pixels'}: none inside the ROI {roi}")
        out = cls.__new__(cls)
        out.sim, out.amplitudes, out.restraint, out.priors, out.background_model = sim, amplitudes, restraint, {}, None
        out.view = View(roi=roi, mask=None, bin=1, fraction=1.0)
        out.n_factor, out.loss, out.loss_fn, out.sparse = 1.0, loss, loss, True
        out.observed_full = out.observed = out.weights = None
        out._set_pixels(used, observed)
        return out

    def _set_pixels(self, used: Tensor, observed: Tensor) -> None:
        """The tables of an objective on given positions (:meth:`from_pixels`, :meth:`rows`)."""
        ny, nx = self.sim.shape
        x0, x1, y0, y1 = self.view.roi
        dt, dev = observed.dtype, observed.device
        self._dx = (torch.arange(x0, x1 + 1, dtype=dt, device=dev) - (nx - 1) / 2.0)[None, :]
        self._dy = (torch.arange(y0, y1 + 1, dtype=dt, device=dev) - (ny - 1) / 2.0)[:, None]
        self._used, self._obs_px, self._gather, self._identity, self._positions = used, observed, None, True, True
        self.pixel_weights = torch.ones((), dtype=dt, device=dev).expand(used.numel())  # no storage per pixel

    @property
    def _dx_px(self) -> Tensor:
        """Fast offsets of the fitted pixels from the image centre (made when a planar background asks, not
        held)."""
        return self._dx.reshape(-1)[self._used % self.view.shape[1]]

    @property
    def _dy_px(self) -> Tensor:
        """Slow offsets of the fitted pixels from the image centre."""
        return self._dy.reshape(-1)[torch.div(self._used, self.view.shape[1], rounding_mode="floor")]

    def with_simulator(self, sim: Simulator) -> "ImageObjective":
        """This objective (view, observed pixels, loss, priors) with another simulator of the same pixels (another
        sampling of the same model, :meth:`nbtorch.Simulator.with_mosaic_domains`); ``self`` is unchanged."""
        new = copy.copy(self)
        new.sim = sim
        return new

    @property
    def used_pixels(self) -> Tensor:
        """Flat indices (row-major in the view) of the fitted pixels of a sparse objective."""
        return self._used

    @property
    def observed_pixels(self) -> Tensor:
        """The observed photons of the fitted pixels of a sparse objective, in :attr:`used_pixels` order."""
        return self._obs_px

    @property
    def n_pixels(self) -> int:
        """Fitted pixels (sparse) or fitted bins (binned)."""
        return self._used.numel() if self.sparse else int((self.weights > 0).sum())

    @property
    def dtype(self) -> torch.dtype:
        return self._obs_px.dtype if self.sparse else self.observed.dtype

    @property
    def device(self) -> torch.device:
        return self._obs_px.device if self.sparse else self.observed.device

    def rows(self, r0: int, r1: int) -> "ImageObjective":
        """The same objective restricted to view rows ``r0:r1`` (unbinned views only)."""
        if self.view.bin != 1:
            raise InputError("rows: only unbinned views can be split into row blocks")
        x0, x1, y0, y1 = self.view.roi
        if self._positions:  # an objective on positions (from_pixels): its positions in those rows
            w = x1 - x0 + 1
            inside = (self._used >= r0 * w) & (self._used < r1 * w)
            out = ImageObjective.__new__(ImageObjective)
            out.__dict__.update(self.__dict__)
            out.view = View(roi=(x0, x1, y0 + r0, y0 + r1 - 1), mask=None, bin=1, fraction=self.view.fraction)
            out.priors, out.restraint = {}, None
            out._set_pixels(self._used[inside] - r0 * w, self._obs_px[inside])
            return out
        sub = View(roi=(x0, x1, y0 + r0, y0 + r1 - 1), mask=self.view.mask[r0:r1], bin=1, fraction=self.view.fraction)
        out = ImageObjective(self.sim, self.observed_full, sub, self.loss, n_factor=self.n_factor,
                             amplitudes=self.amplitudes, background_model=self.background_model)
        out.loss_fn = self.loss_fn
        return out

    def render_overrides(self, values: Mapping[str, Tensor | float], grid: Tensor | None = None) -> dict:
        """The Simulator's ``render`` keyword arguments of this stage at ``values`` (size factor and amplitude
        grid applied; ``grid``: this (nh, nk, nl) amplitude table instead of the one of ``values``)."""
        overrides = {n: values[n] for n in PARAMETER_NAMES + ORIENTATION_DELTAS}
        if self.sim.panel_layout is not None:  # every panel's geometry (its group's change included)
            overrides.update({n: values[n] for n in self.sim.panel_layout.names()})
        if self.n_factor != 1.0:
            for n in SIZE_DIAGONAL + SIZE_OFF_DIAGONAL:  # the whole size matrix
                overrides[n] = overrides[n] * self.n_factor
        if grid is not None:
            overrides["F_grid"] = grid
        elif self.amplitudes is not None:
            overrides["F_grid"] = self.amplitudes.grid(values, self.dtype, self.device)
        return overrides

    def full_model(self, values: Mapping[str, Tensor | float], grid: Tensor | None = None) -> Tensor:
        """Unbinned model photons on the view's ROI, shape ``view.shape`` (``grid``: :meth:`render_overrides`)."""
        image, _ = self.sim.render(roi=self.view.roi, **self.render_overrides(values, grid))
        return _photons(image, values, self._dx, self._dy, self._background(values, None))

    def model(self, values: Mapping[str, Tensor | float], grid: Tensor | None = None) -> Tensor:
        """Binned model photons, shape ``view.binned_shape``."""
        return self.view.pool(self.full_model(values, grid))

    def pixel_model(self, values: Mapping[str, Tensor | float], grid: Tensor | None = None) -> Tensor:
        """Model photons on the fitted pixels only (sparse path): a vector, in the order of ``view.mask``'s True
        pixels (``grid``: :meth:`render_overrides`)."""
        overrides = self.render_overrides(values, grid)
        if self._positions:
            simulated, _, _ = self.sim.render_pixels(roi=self.view.roi, pixels=self._used, **overrides)
        else:
            simulated, _, _ = self.sim.render_pixels(roi=self.view.roi, **overrides)
        if not self._identity:
            simulated = torch.cat([simulated, simulated.new_zeros(1)])[self._gather]
        return _photons(simulated, values, lambda: self._dx_px, lambda: self._dy_px, self._background(values, self._used))

    def _background(self, values: Mapping[str, Tensor | float], used: Tensor | None) -> Tensor | None:
        """The background model's photons on the view (``used``: its flat positions), None without a model."""
        model = getattr(self, "background_model", None)
        if model is None:
            return None
        return model.photons(values, self.view.roi, used, self.dtype, self.device)

    def model_image(self, aux: Tensor) -> Tensor:
        """The binned model image from :meth:`evaluate`'s ``aux`` (the model on the fitted pixels when sparse)."""
        if not self.sparse:
            return aux
        flat = aux.new_zeros(self.view.shape[0] * self.view.shape[1]).index_put((self._used,), aux)
        return flat.reshape(self.view.shape)

    def pixels(self, values: Mapping[str, Tensor | float],
               grid: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(model, observed, weights)`` of the fitted pixels (sparse) or the view's (binned) image, flattened
        (``grid``: :meth:`render_overrides`)."""
        if self.sparse:
            return self.pixel_model(values, grid), self._obs_px, self.pixel_weights
        return self.model(values, grid).reshape(-1), self.observed.reshape(-1), self.weights.reshape(-1)

    def evaluate(self, values: Mapping[str, Tensor | float]) -> tuple[Tensor, Tensor]:
        """``(loss, aux)``: the loss (with the priors' term) and the model in the cheapest form (see
        :meth:`model_image`)."""
        if self.sparse:
            model = self.pixel_model(values)
            loss = self.loss_fn(model, self._obs_px, self.pixel_weights)
        else:
            model = self.model(values)
            loss = self.loss_fn(model, self.observed, self.weights)
        if self.priors:
            loss = loss + self.prior_term(values)
        if self.restraint is not None:
            loss = loss + self.restraint(values, loss.dtype, loss.device)
        return loss, model

    def prior_term(self, values: Mapping[str, Tensor | float]) -> Tensor:
        """``sum 0.5 ((value - mean) / sigma)^2`` over the priors (0 without priors): the negative log of
        Gaussian priors, on the scale of the half deviance (a change of 0.5 is one standard deviation)."""
        total = torch.zeros((), dtype=self.dtype, device=self.device)
        for name, (mean, sigma) in self.priors.items():
            total = total + gaussian_restraint_terms(torch.as_tensor(values[name], dtype=total.dtype), mean, sigma)
        return total

    def __call__(self, values: Mapping[str, Tensor | float]) -> tuple[Tensor, Tensor]:
        """``(loss, binned model image)``."""
        loss, aux = self.evaluate(values)
        return loss, self.model_image(aux)


def _photons(simulated: Tensor, values: Mapping[str, Tensor | float], dx: Tensor, dy: Tensor,
             background: Tensor | None = None) -> Tensor:
    """``scale * simulated + background [+ background_x * dx + background_y * dy]`` (photons per pixel).

    ``dx``, ``dy``: pixel offsets from the image centre (fast, slow), broadcastable to ``simulated``, or
    functions giving them (called only for a planar background).  ``background``: a background model's photons
    (:mod:`refine.fitting.background`) used instead of the flat ``background`` value.
    """
    def here(v):  # a parameter on the CPU (a refinement's raw values) with a model on a GPU: the model's device
        return v.to(simulated.device) if isinstance(v, Tensor) and v.device != simulated.device else v

    model = here(values["scale"]) * simulated + here(values["background"] if background is None else background)
    bx, by = here(values.get("background_x", 0.0)), here(values.get("background_y", 0.0))
    if isinstance(bx, Tensor) or bx != 0.0:
        model = model + bx * (dx() if callable(dx) else dx)
    if isinstance(by, Tensor) or by != 0.0:
        model = model + by * (dy() if callable(dy) else dy)
    return model
