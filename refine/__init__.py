"""The refinement layer: fit simulator parameters to an observed still image.

Front door::

    from refine import Measurement, Settings, refine_still
    m = Measurement.from_dials("indexed.expt", "indexed.refl", image="still.cbf")   # what nbtorch-refine reads
    result = refine_still(m, Settings.of(max_steps=100), say=print)               # and does, printed alike

    from refine import refine, make_problem
    result = refine(make_problem("cubic_mosflm", size=64))      # synthetic problem with known truth
    result = refine(simulator, observed, symmetry="tetragonal", fixed=("distance",))
    save_json(result, "result.json"); save_h5(result, "result.h5")

Public names (implementation modules: ``parameters``, ``objective``, ``loop``,
``strategies``, ``stages``, ``uncertainty``, ``results``, ``checkpoint``,
``callbacks``, ``problems``, ``transforms``; see docs/python.md):

* what ``nbtorch-refine`` does, from Python (:mod:`refine.modes.entry`): :class:`Measurement` (its constructors
  ``from_dials``, ``from_images``, ``from_problem``), :class:`Settings`, :func:`refine_still`,
  :func:`refine_stills_jointly`, :func:`refine_rotation_series`, :func:`refine_serial`, :func:`refine_each`;
* :func:`refine`, :class:`RefinementResult`, :class:`RefinementInterrupted`, :func:`save_json`,
  :func:`save_h5`, :func:`load_h5`;
* joint mode (many stills, shared cell; :mod:`refine.many.joint`): :func:`refine_joint`, :class:`JointResult`;
* stages and step rules: :class:`Stage`, :func:`stage_a`, :func:`single_stage`,
  :func:`coarse_to_fine`, :class:`LBFGS`, :class:`Adam`, :class:`Convergence`, :class:`Status`,
  :func:`minimise` (the loop on any ``raw -> loss`` function);
* parameters: :class:`ParameterSpace`, :class:`ParameterMap`, :data:`GROUPS`, :data:`SYMMETRIES`,
  :data:`UNITS`; transforms :class:`Transform`, :class:`Identity`, :class:`Positive`,
  :class:`LogPositive`, :class:`Bounded`, :class:`Multiplicative`, :func:`default_transform`;
* uncertainties: :func:`estimate_uncertainties`, :class:`Uncertainties`;
* callbacks: :class:`Callback`, :class:`AbstractCallback`, :class:`NullCallback`,
  :class:`ProgressCallback`, :class:`TensorBoardCallback`, :class:`StepState`, :class:`RunInfo`;
* checkpoints: :func:`read_checkpoint`, :func:`write_checkpoint`;
* problems: :func:`make_problem`, :func:`make_stills`, :data:`PROBLEMS`, :class:`Problem`;
* the loss: :func:`poisson_deviance`.
"""

from __future__ import annotations

from refine.output.callbacks import (
    AbstractCallback, Callback, NullCallback, ProgressCallback, RunInfo, StepState, TensorBoardCallback,
)
from refine.solver.checkpoint import read_checkpoint, write_checkpoint
from refine.many.joint import JointResult, refine_joint
from refine.solver.loop import Convergence, Status, minimise
from refine.fitting.objective import poisson_deviance
from refine.fitting.parameters import GROUPS, SYMMETRIES, UNITS, ParameterMap, ParameterSpace
from refine.inputs.problems import PROBLEMS, Problem, make_problem, make_stills
from refine.output.results import RefinementResult, load_h5, save_h5, save_json
from refine.solver.runner import RefinementInterrupted, refine
from refine.solver.stages import Stage, coarse_to_fine, single_stage, stage_a
from refine.solver.strategies import LBFGS, Adam
from refine.fitting.transforms import (
    TRANSFORM_NAMES, Bounded, Identity, LogPositive, Multiplicative, Positive, Transform, default_transform,
)
from refine.quality.uncertainty import Uncertainties, estimate_uncertainties
from refine.inputs.measurement import Measurement
from refine.settings import Settings
from refine.modes.entry import (refine_each, refine_rotation_series, refine_serial, refine_still,
                               refine_stills_jointly)

__all__ = [
    "Measurement", "Settings", "refine_still", "refine_stills_jointly", "refine_rotation_series", "refine_serial",
    "refine_each",
    "refine", "refine_joint", "JointResult", "RefinementResult", "RefinementInterrupted", "save_json", "save_h5", "load_h5",
    "Stage", "stage_a", "single_stage", "coarse_to_fine", "LBFGS", "Adam", "Convergence", "Status", "minimise",
    "ParameterSpace", "ParameterMap", "GROUPS", "SYMMETRIES", "UNITS",
    "Transform", "Identity", "Positive", "LogPositive", "Bounded", "Multiplicative", "default_transform",
    "TRANSFORM_NAMES",
    "estimate_uncertainties", "Uncertainties",
    "Callback", "AbstractCallback", "NullCallback", "ProgressCallback", "TensorBoardCallback", "StepState", "RunInfo",
    "read_checkpoint", "write_checkpoint",
    "make_problem", "make_stills", "PROBLEMS", "Problem",
    "poisson_deviance",
]
