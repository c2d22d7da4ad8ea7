"""Callbacks: observe a refinement from outside the compiled region; the default does nothing.

The loop calls every callback at fixed points with plain Python numbers and
detached tensors, after the loss and gradients of a step are complete, so a
callback can never break or re-trigger a compiled graph:

* ``on_run_start(info)``: :class:`RunInfo` (stages, free names, hyper-parameters);
* ``on_stage_start(stage, index)``;
* ``on_step(state)``: :class:`StepState` after the start point of each stage and after every step;
* ``on_stage_end(stage, index, status, message)``;
* ``on_run_end(result)``: the :class:`~refine.output.results.RefinementResult`.

Implement :class:`Callback` (a ``Protocol``) or subclass :class:`AbstractCallback`
(every method a no-op).  Provided: :class:`NullCallback` (the default),
:class:`ProgressCallback` (a tqdm bar: stage, step, loss, status) and
:class:`TensorBoardCallback` (scalars, histograms, images and hyper-parameters;
``torch.utils.tensorboard`` is imported only when it starts).
"""

from __future__ import annotations

import sys
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from nbtorch.parameters import MISSET_NAMES, ORIENTATION_DELTAS
from refine.fitting.background import is_knot
from refine.fitting.parameters import REFINABLE
from refine.fitting.structure_factors import is_amplitude

if TYPE_CHECKING:  # pragma: no cover
    from refine.solver.loop import Status
    from refine.output.results import RefinementResult
    from refine.solver.stages import Stage

__all__ = ["RunInfo", "StepState", "Callback", "AbstractCallback", "NullCallback", "ProgressCallback",
           "TensorBoardCallback", "CallbackList", "parameter_tag", "bin_image", "diagnostic_scalars", "profile_image"]

#: TensorBoard tag prefixes of per-parameter scalars: values and d loss / d raw
TAG_KINDS = ("params", "grads")


def parameter_tag(name: str, kind: str = "params") -> str:
    """TensorBoard tag ``<kind>/<name>`` of a refinable name (the parameter table's vocabulary).

    Raises ValueError for a name outside :data:`refine.fitting.parameters.REFINABLE` (and a resolution
    background's knots ``background_<k>``) or an unknown kind: a tag never invents a name the result files do not
    use.
    """
    if kind not in TAG_KINDS:
        raise ValueError(f"unknown tag kind {kind!r}; expected one of {', '.join(TAG_KINDS)}")
    if name not in REFINABLE and not is_knot(name):
        raise ValueError(f"no TensorBoard tag for {name!r}: not a parameter name ({', '.join(REFINABLE)})")
    return f"{kind}/{name}"


@dataclass(frozen=True)
class RunInfo:
    """What a run is about to do.

    Attributes:
        stages: the stages' settings (``Stage.describe()``), in order.
        names: every name refined in some stage.
        hparams: flat hyper-parameters (strategy, symmetry, loss, ...).
        max_steps: sum of the stages' step limits (a progress-bar total).
        first_step: global step the run starts at (> 0 when resuming).
    """

    stages: tuple[dict, ...]
    names: tuple[str, ...]
    hparams: dict
    max_steps: int
    first_step: int = 0


@dataclass(frozen=True)
class StepState:
    """The state after one step (or at a stage's start), outside any compiled region.

    Attributes:
        stage: stage name; ``stage_index`` its position.
        step: global step (one per history row, monotonic over the run).
        stage_step: steps taken in this stage (0 = its start point).
        loss: loss of this stage's view.
        grad_norm: largest gradient component (raw units).
        params: free name -> physical value (units: :data:`refine.fitting.parameters.UNITS`).
        grads: free name -> d loss / d raw.
        canonical: every canonical parameter (and nuisance) with the orientation folded into the misset.
        model, observed: this stage's (binned) view of model and observed photons, detached;
            ``weights`` marks the bins used (1) and unused (0).  ``model`` may be given as a function
            returning it: it is then made on first use (a sparse refinement's model image is the fitted pixels
            put into the whole view, ~6 ms for a 6-megapixel detector, wanted only by image-logging steps).
    """

    stage: str
    stage_index: int
    step: int
    stage_step: int
    loss: float
    grad_norm: float
    params: dict
    grads: dict
    canonical: dict
    model: InitVar[Tensor | Callable[[], Tensor] | None] = None
    observed: Tensor | None = None
    weights: Tensor | None = None
    _model: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self, model: Tensor | Callable[[], Tensor] | None) -> None:
        object.__setattr__(self, "_model", model)


def _step_model(state: StepState) -> Tensor | None:
    """:attr:`StepState.model`, made on first use when given as a function."""
    if callable(state._model):
        object.__setattr__(state, "_model", state._model())
    return state._model


StepState.model = property(_step_model)  # type: ignore[assignment,method-assign]  # after the dataclass's __init__


@runtime_checkable
class Callback(Protocol):
    """What the loop calls (see the module docstring)."""

    def on_run_start(self, info: RunInfo) -> None: ...
    def on_stage_start(self, stage: "Stage", index: int) -> None: ...
    def on_step(self, state: StepState) -> None: ...
    def on_stage_end(self, stage: "Stage", index: int, status: "Status", message: str) -> None: ...
    def on_run_end(self, result: "RefinementResult") -> None: ...


class AbstractCallback:
    """Base class with every callback method a no-op."""

    def on_run_start(self, info: RunInfo) -> None:
        pass

    def on_stage_start(self, stage: "Stage", index: int) -> None:
        pass

    def on_step(self, state: StepState) -> None:
        pass

    def on_stage_end(self, stage: "Stage", index: int, status: "Status", message: str) -> None:
        pass

    def on_run_end(self, result: "RefinementResult") -> None:
        pass


class NullCallback(AbstractCallback):
    """Does nothing (the default)."""


@dataclass
class CallbackList(AbstractCallback):
    """Calls each callback in turn."""

    callbacks: list = field(default_factory=list)

    def on_run_start(self, info: RunInfo) -> None:
        for c in self.callbacks:
            c.on_run_start(info)

    def on_stage_start(self, stage: "Stage", index: int) -> None:
        for c in self.callbacks:
            c.on_stage_start(stage, index)

    def on_step(self, state: StepState) -> None:
        for c in self.callbacks:
            c.on_step(state)

    def on_stage_end(self, stage: "Stage", index: int, status: "Status", message: str) -> None:
        for c in self.callbacks:
            c.on_stage_end(stage, index, status, message)

    def on_run_end(self, result: "RefinementResult") -> None:
        for c in self.callbacks:
            c.on_run_end(result)


class ProgressCallback(AbstractCallback):
    """A tqdm progress bar on stderr showing stage, step, loss and status.

    Arguments:
        quiet: no bar at all (for scripts); ``None`` = quiet unless stderr is a terminal.
        file: stream for the bar (default ``sys.stderr``).
    """

    def __init__(self, quiet: bool | None = None, file: Any = None) -> None:
        self.file = file if file is not None else sys.stderr
        self.quiet = (not getattr(self.file, "isatty", lambda: False)()) if quiet is None else bool(quiet)
        self.bar = None
        self._stage = ""

    def on_run_start(self, info: RunInfo) -> None:
        if self.quiet:
            return
        from tqdm import tqdm

        self.bar = tqdm(total=info.max_steps, desc="refine", unit="step", file=self.file, dynamic_ncols=True)

    def on_stage_start(self, stage: "Stage", index: int) -> None:
        self._stage = stage.name

    def on_step(self, state: StepState) -> None:
        if self.bar is None:
            return
        if state.stage_step > 0:
            self.bar.update(1)
        self.bar.set_postfix_str(f"{state.stage} step {state.stage_step} loss {state.loss:.6g} running", refresh=False)

    def on_stage_end(self, stage: "Stage", index: int, status: "Status", message: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{stage.name} {status.value}")

    def on_run_end(self, result: "RefinementResult") -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {result.loss_final:.6g} {result.status.value}")
            self.bar.close()
            self.bar = None


class TensorBoardCallback(AbstractCallback):
    """Write a TensorBoard log: scalars every step, histograms and images every ``every`` steps (made and encoded
    on a worker thread while the loop goes on; the run's end waits for them).

    Tags: ``loss``, ``grad_norm``, ``stage`` (index), ``params/<name>`` for every free
    name (:func:`parameter_tag`: the names of the parameter table, :mod:`nbtorch.parameters`;
    with the orientation free also ``params/misset_x/y/z``), ``grads/<name>``; every ``every`` steps the histogram ``residuals`` and the images
    ``images/observed``, ``images/model``, ``images/residual`` (observed - model, 0.5 = zero; each binned, summed
    over squares of the smallest whole number of pixels that brings its longer side to ``max_image_px`` or
    fewer: a 2463 x 2527 Pilatus 6M in squares of 3, 821 x 843; the PNG encoding, ~1 s for a whole 6M image,
    scales with the pixels; the thaumatin tutorial's 1200 x 1200 view in squares of 2: its logging 0.8 s
    instead of 1.9 s);
    at the end ``add_hparams`` with the run's hyper-parameters and ``hparam/loss_final``,
    ``hparam/steps``, and what the model misses (the result's ``diagnostics``, :mod:`refine.quality.misfit`) at the
    last step: scalars ``diagnostics/sigZ``, ``diagnostics/fraction_z_above_5``, ``diagnostics/profile/<observed or
    model>/<number>``, ``diagnostics/profile/excess_3to5_px``, ``diagnostics/background/<observed or model>_mean``
    and the image ``diagnostics/spot_profile`` (observed, model and observed - model stacks side by side, each
    pixel 8 x 8; 0.5 = zero in the difference).  The global step is :attr:`StepState.step`.

    Arguments:
        logdir: directory of the event files.
        every: period (steps) of histograms and images (0 = never).
        writer: an existing ``SummaryWriter``-like object instead of creating one.
        max_image_px: the longest side of a logged image (larger views are binned), >= 1.
    """

    def __init__(self, logdir: str | None = None, every: int = 10, writer: Any = None,
                 max_image_px: int = 1024) -> None:
        if int(max_image_px) != max_image_px or max_image_px < 1:
            raise ValueError(f"max_image_px: expected a whole number >= 1, got {max_image_px!r}")
        self.logdir = logdir
        self.every = int(every)
        self.max_image_px = int(max_image_px)
        self.writer = writer
        self._own = writer is None
        self._hparams: dict = {}
        self._pool = None  # the worker thread of the images (on_step)
        self._pending: list = []
        self._observed = None  # (observed, weights, its host copy, mask, binned image): _observed_images

    def on_run_start(self, info: RunInfo) -> None:
        if self.writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # pragma: no cover - depends on the environment
                raise ImportError("TensorBoardCallback needs tensorboard: pip install tensorboard") from exc
            self.writer = SummaryWriter(log_dir=self.logdir)
        self._hparams = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in info.hparams.items()}

    def on_step(self, state: StepState) -> None:
        w = self.writer
        if w is None:
            return
        s = state.step
        scalars = {"loss": state.loss, "grad_norm": state.grad_norm, "stage": state.stage_index}
        amplitudes = []
        for name, value in state.params.items():
            if is_amplitude(name):  # hundreds of them: one histogram, not a tag each
                amplitudes.append(value)
                continue
            scalars[parameter_tag(name)] = value
            scalars[parameter_tag(name, "grads")] = state.grads.get(name, 0.0)
        if any(n in ORIENTATION_DELTAS for n in state.params):
            for name in MISSET_NAMES:
                scalars[parameter_tag(name)] = state.canonical[name]
        _add_scalars(w, scalars, s)
        if amplitudes:
            w.add_histogram("structure_factors", np.asarray(amplitudes), s)
        if self.every > 0 and s % self.every == 0 and state.model is not None and state.observed is not None:
            # here only the model's copy to the host; binning, histogram and PNG encoding on the worker thread
            # (~0.7 s for the tutorial's 1200 x 1200 view), so the loop does not wait for them
            self._check_worker()
            self._pending.append(self._worker().submit(self._log_images, state.model.detach().to("cpu", torch.float64),
                                                       state.observed, state.weights, s))

    def _worker(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nbtorch-tensorboard")
        return self._pool

    def _check_worker(self, wait: bool = False) -> None:
        """Re-raise here an error of an image logged on the worker thread; with ``wait``, wait for every one."""
        pending, self._pending = self._pending, []
        for future in pending:
            if wait or future.done():
                future.result()
            else:
                self._pending.append(future)

    def wait(self) -> None:
        """Wait until the images of every step so far are written (the run's end does); an error of one is raised
        here."""
        self._check_worker(wait=True)

    def _observed_images(self, observed: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor]:
        """``(observed on the host, fitted-pixel mask, binned observed image in [0, 1])``, made once per stage's view
        (the same tensors every step)."""
        if self._observed is None or self._observed[0] is not observed or self._observed[1] is not weights:
            obs = observed.detach().to("cpu", torch.float64)
            used = weights.detach().cpu() > 0 if weights is not None else None
            self._observed = (observed, weights, obs, used, _unit_range(bin_image(obs, self.max_image_px)))
        return self._observed[2], self._observed[3], self._observed[4]

    def _log_images(self, model: Tensor, observed: Tensor, weights: Tensor | None, step: int) -> None:
        """The residuals' histogram and the observed, model and residual images of one step (the worker thread)."""
        w = self.writer
        obs, used, obs_image = self._observed_images(observed, weights)
        resid = obs - model
        w.add_histogram("residuals", resid[used] if used is not None else resid, step)
        model, resid = bin_image(model, self.max_image_px), bin_image(resid, self.max_image_px)
        w.add_image("images/observed", obs_image, step, dataformats="HW")
        w.add_image("images/model", _unit_range(model), step, dataformats="HW")
        scale = float(resid.abs().max()) or 1.0
        w.add_image("images/residual", (0.5 + 0.5 * resid / scale).clamp(0, 1), step, dataformats="HW")

    def on_run_end(self, result: "RefinementResult") -> None:
        w = self.writer
        if w is None:
            return
        self.wait()  # every step's images written before the run's last events
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        diagnostics = getattr(result, "diagnostics", None) or {}
        _add_scalars(w, diagnostic_scalars(diagnostics), int(result.steps))
        if diagnostics.get("profile"):
            w.add_image("diagnostics/spot_profile", profile_image(diagnostics["profile"]), int(result.steps),
                        dataformats="HW")
        metrics = {"hparam/loss_final": float(result.loss_final), "hparam/steps": float(result.steps)}
        hp = dict(self._hparams)
        hp["status"] = result.status.value
        w.add_hparams(hp, metrics, run_name=".")
        w.flush()
        if self._own:
            w.close()
            self.writer = None


def _add_scalars(writer: Any, scalars: dict[str, float], step: int) -> None:
    """Each ``tag -> value`` as ``writer.add_scalar(tag, value, step)`` would log it, but for a torch
    ``SummaryWriter`` as one event of the step (one summary with every value: TensorBoard shows the same
    curves; one event per scalar cost ~0.2 s of the README's main job, 185 steps x 28 scalars)."""
    file_writer = getattr(writer, "_get_file_writer", None)
    if file_writer is None:  # another SummaryWriter-like object: its public method
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, step)
        return
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard.summary import scalar
    values = [v for tag, value in scalars.items() for v in scalar(tag, value).value]
    file_writer().add_summary(Summary(value=values), step)


def diagnostic_scalars(diagnostics: dict) -> dict[str, float]:
    """TensorBoard tags and values of a result's ``diagnostics`` (:class:`TensorBoardCallback`; missing or null
    numbers are left out)."""
    out = {f"diagnostics/{k}": diagnostics.get(k) for k in ("sigZ", "mean_z", "fraction_z_above_5")}
    profile = diagnostics.get("profile") or {}
    for side in ("observed", "model", "model_own"):
        for k, v in (profile.get(side) or {}).items():
            if not isinstance(v, list):
                out[f"diagnostics/profile/{side}/{k}"] = v
    out["diagnostics/profile/excess_3to5_px"] = profile.get("excess_3to5_px")
    table = diagnostics.get("background_by_resolution") or {}
    for k in ("observed_mean", "model_mean"):
        out[f"diagnostics/background/{k}"] = table.get(k)
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and np.isfinite(v)}


def profile_image(profile: dict, zoom: int = 8) -> Tensor:
    """The spot profile's observed, model and observed - model stacks side by side (one column of 0 between),
    observed and model on one scale from 0 to 1, the difference about 0.5; each pixel ``zoom`` x ``zoom``."""
    obs, mod = (torch.as_tensor(profile[k], dtype=torch.float64) for k in ("stack_observed", "stack_model"))
    lo, hi = float(torch.minimum(obs, mod).min()), float(torch.maximum(obs, mod).max())
    span = hi - lo if hi > lo else 1.0
    diff = obs - mod
    scale = float(diff.abs().max()) or 1.0
    gap = obs.new_zeros(obs.shape[0], 1)
    image = torch.cat([(obs - lo) / span, gap, (mod - lo) / span, gap, 0.5 + 0.5 * diff / scale], dim=1)
    return image.clamp(0, 1).repeat_interleave(zoom, 0).repeat_interleave(zoom, 1)


def bin_image(image: Tensor, max_px: int) -> Tensor:
    """``image`` (rows, columns) summed over squares of ``k`` x ``k`` pixels, ``k`` the smallest whole number
    that makes both sides ``ceil(side / k) <= max_px`` (the last row and column of squares may be partial);
    unchanged when it already fits."""
    rows, cols = image.shape
    k = max(-(-rows // max_px), -(-cols // max_px), 1)
    if k == 1:
        return image
    dev = image.device  # rows, then columns, added into their squares (5x faster than a padded reshape's sum)
    by_rows = image.new_zeros(-(-rows // k), cols).index_add_(0, torch.arange(rows, device=dev) // k, image)
    return by_rows.new_zeros(by_rows.shape[0], -(-cols // k)).index_add_(1, torch.arange(cols, device=dev) // k,
                                                                         by_rows)


def _unit_range(x: Tensor) -> Tensor:
    lo, hi = float(x.min()), float(x.max())
    return ((x - lo) / (hi - lo)).clamp(0, 1) if hi > lo else x * 0.0
