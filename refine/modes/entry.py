"""The front door for Python: a :class:`~refine.inputs.measurement.Measurement` and its
:class:`~refine.settings.Settings` in, the refinement's result out, printed as ``nbtorch-refine`` prints it.

::

    from refine import Measurement, Settings, refine_still

    m = Measurement.from_dials("indexed.expt", "indexed.refl", image="still_0001.cbf")
    result = refine_still(m, Settings.of(max_steps=100, out="out/result.h5"), say=print)

* :func:`refine_still`: one image (a still, one image of a scan, or a synthetic problem);
* :func:`refine_stills_jointly`: many stills together (the images of ``measurement.images``, or the stills of one
  DIALS file);
* :func:`refine_rotation_series`: the images of a rotation scan together (one crystal turning);
* :func:`refine_serial`: a serial set in rounds, the images that do not fit dropped with their reasons;
* :func:`refine_each`: many images (or the stills of one DIALS file) each on its own, with a summary.

Each takes ``say``, a function that gets every line ``nbtorch-refine`` prints (``say=print`` prints them; default:
logged through :mod:`logging`, logger ``refine.modes.entry``).

``nbtorch-refine`` turns its options into the same two values at the door and calls :func:`run_job`, which picks
the run as these functions do.  Each function writes the files the settings name (``output.out``,
``many.out_dir``, ...) and returns the result (:class:`~refine.output.results.RefinementResult`,
:class:`~refine.many.joint_result.JointResult`, :class:`~refine.many.serial.SerialResult`) or, for
:func:`refine_each`, the exit status of the batch.  Bad input raises :class:`~nbtorch.errors.InputError` (one line).
"""

from __future__ import annotations

import logging
from typing import Callable

from nbtorch.errors import InputError
from refine.inputs.measurement import Measurement
from refine.many.serial import SerialResult
from refine.modes.independent import many_dials_stills, run_independent
from refine.modes.job import Job
from refine.modes.joint import run_joint
from refine.modes.single import refine_one, run
from refine.modes.stills_file import joint_stills, run_stills_independent, still_images
from refine.settings import Settings

__all__ = ["refine_still", "refine_stills_jointly", "refine_rotation_series", "refine_serial", "refine_each",
           "run_job", "exit_status"]

Say = Callable[[str], None]

log = logging.getLogger(__name__)


def _job(measurement: Measurement, settings: Settings | None, **fields) -> Job:
    job = Job(measurement, settings if settings is not None else Settings())
    return job.with_fields(**fields) if fields else job


def _say(job: Job, say: Say | None) -> Say:
    """``say``, else each line logged (``INFO``), nothing with ``output.quiet``."""
    if say is not None:
        return say
    return (lambda line: None) if job.output.quiet else (lambda line: log.info("%s", line))


def refine_still(measurement: Measurement, settings: Settings | None = None, say: Say | None = None):
    """Refine one image (``measurement.image.image``, or ``measurement.model.problem``); its files written to
    ``settings.output.out`` (and ``.json``); returns the :class:`~refine.output.results.RefinementResult`."""
    job = _job(measurement, settings)
    return refine_one(job, _say(job, say))


def _joint(job: Job, say: Say | None):
    say = _say(job, say)
    if joint_stills(job):
        return run_joint(job, say, still_images(job, say))
    if not job.images:
        raise InputError("--images: a joint refinement needs the images (Measurement.images)")
    return run_joint(job, say)


def refine_stills_jointly(measurement: Measurement, settings: Settings | None = None, say: Say | None = None):
    """Refine many stills together (``measurement.images``, or the stills of one DIALS file with no image given),
    the names of ``settings.many.shared`` shared; results in ``settings.many.out_dir``; returns the
    :class:`~refine.many.joint_result.JointResult`."""
    return _joint(_job(measurement, settings, joint=True), say)


def refine_rotation_series(measurement: Measurement, settings: Settings | None = None, say: Say | None = None):
    """Refine the images of a rotation scan together (``measurement.images``; with DIALS files, each matched to the
    scan); returns the :class:`~refine.many.joint_result.JointResult`."""
    return _joint(_job(measurement, settings, joint=True, rotation_series=True), say)


def refine_serial(measurement: Measurement, settings: Settings | None = None, say: Say | None = None) -> SerialResult:
    """Refine a serial set together in rounds, the images that do not fit dropped with their reasons
    (``settings.many.add_to``: continue a finished run); returns the :class:`~refine.many.serial.SerialResult`."""
    return _joint(_job(measurement, settings, joint=True, screen=True), say)


def refine_each(measurement: Measurement, settings: Settings | None = None, say: Say | None = None) -> int:
    """Refine many images each on its own (``measurement.images``, or the stills of one DIALS file), each into its
    folder of ``settings.many.out_dir`` with a summary; returns the exit status (0: every image refined)."""
    job = _job(measurement, settings)
    say = _say(job, say)
    if many_dials_stills(job):
        return run_stills_independent(job, run, say)
    return run_independent(job, run, say)


def exit_status(result) -> int:
    """0 when the refinement converged or stopped at its step limit, 1 otherwise."""
    joint = result.joint if isinstance(result, SerialResult) else result
    return 0 if joint.status.ok else 1


def run_job(job: Job, say: Say | None = None) -> int:
    """The run ``job`` asks for (``nbtorch-refine``'s modes): the stills of one DIALS file jointly or each alone,
    many images jointly or each alone, else one image; returns the exit status."""
    say = _say(job, say)
    stills = joint_stills(job) or many_dials_stills(job)
    if stills and job.dials.expt_out:
        raise InputError(f"--expt-out {job.dials.expt_out}: the stills of one DIALS file are written together, "
                         "every experiment refined, to OUT_DIR/refined.expt")
    if joint_stills(job):
        return exit_status(run_joint(job, say, still_images(job, say)))
    if job.images and job.many.joint:
        return exit_status(run_joint(job, say))
    if many_dials_stills(job):
        return run_stills_independent(job, run, say)
    if job.images:
        return run_independent(job, run, say)
    return exit_status(refine_one(job, say))
