"""What the experiments refine, prepared exactly as ``nbtorch-refine`` prepares it.

Both scripts take nbtorch-refine's options (its option groups, added to their parser by
:func:`refine.cli.parser.build_parser`, ``--config`` TOML included) plus options of their own, and turn
them into refine's typed :class:`refine.cli.options.Options` (:func:`parse_experiment`).
:func:`load_workload` then runs the one preparation path, :func:`refine.modes.single.prepare`: header
geometry, ``--expt``/``--refl``, the pixel choice (``--roi``, ``--dmin``, ``--spots``, ``--spot-window``,
``--subsample``), the simulator restricted to the fitted pixels, the starting scale and background.  Bad
input therefore fails as in nbtorch-refine (:class:`InputError`, one line), before anything is written.

Without ``--image``, ``--expt`` or ``--problem`` the experiments refine the bank problem
:data:`DEFAULT_PROBLEM` (``--size`` default :data:`DEFAULT_SIZE`).
:func:`parameter_error` measures how far a set of parameters is from the truth as the RMS of the errors
left, each relative to the start's error (1 = no progress, 0 = the truth); the orientation counts once, as
the misorientation angle.  :func:`refine_config_toml` writes options as an ``nbtorch-refine --config`` file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from nbtorch import Simulator
from nbtorch.runtime import policy as runtime
from nbtorch.cli.support import Parser
from nbtorch.errors import InputError
from refine.cli.options import GROUP_TITLES, Options, options_from_namespace
from refine.cli.parser import build_parser, parse_namespace
from refine.modes.single import Prepared, plan_arguments, prepare
from refine.inputs.problems import misorientation_deg

__all__ = ["Workload", "load_workload", "parse_experiment", "experiment_parser", "parameter_error",
           "refine_config_toml", "DEFAULT_PROBLEM", "DEFAULT_SIZE", "IMAGE_FREE"]

#: the bank problem refined when no image is given, and its default size
DEFAULT_PROBLEM = "cubic_mosflm"
DEFAULT_SIZE = 32
#: what a measured image refines by default when a schedule needs a list of names (one stage)
IMAGE_FREE = ("scale", "background", "orientation", "cell", "beam_centre", "mosaic")
#: names whose error counts in :func:`parameter_error` (besides the misorientation)
ERROR_NAMES = ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta", "cell_gamma", "beam_x", "beam_y",
               "distance", "mosaic_spread", "N_a", "N_b", "N_c", "scale")
#: output files of nbtorch-refine (the experiments write to ``--outdir`` instead; a written config names its own)
OUTPUT_PATHS = ("out", "json", "hkl_out", "report", "logdir", "checkpoint", "expt_out")


def experiment_parser(prog: str, description: str, title: str) -> tuple[argparse.ArgumentParser, Any]:
    """A parser with nbtorch-refine's option groups (``--size`` default :data:`DEFAULT_SIZE`) and an empty
    group ``title`` for the script's own options."""
    parser = Parser(prog=prog, description=description, epilog="nbtorch-refine's options: docs/options.md; "
                    "the scripts: docs/stage-a.md, docs/hyperparameter-sweeps.md")
    own = parser.add_argument_group(title)
    build_parser(parser)
    parser.set_defaults(size=DEFAULT_SIZE)
    return parser, own


def parse_experiment(argv: Sequence[str], parser: argparse.ArgumentParser, own: type) -> tuple[Options, Any]:
    """``argv`` (after ``--config``) as refine's :class:`Options` and the script's own options (the frozen
    dataclass ``own``, whose fields are the script's parser destinations).  Checks what the experiments do
    not run: many images, ``--resume``."""
    ns = parse_namespace(argv, parser)
    mine = own(**{f.name: vars(ns).pop(f.name) for f in dataclasses.fields(own)})
    options = options_from_namespace(ns, tuple(argv))
    if options.images:
        raise InputError("--images: the experiments refine one image (give --image)")
    if options.output.resume:
        raise InputError("--resume: the experiments always start from the model (no checkpoint)")
    if not (options.image.image or options.model.problem or options.model.model or options.dials.expt):
        options = options.with_fields(problem=DEFAULT_PROBLEM)
    return options, mine


@dataclass(frozen=True)
class Workload:
    """One refinement input, prepared as nbtorch-refine prepares it.

    Attributes:
        label: image path or ``problem (size x size)``.
        options: the typed options.
        prepared: :func:`refine.modes.single.prepare`'s result (``prepared.sim``: the simulator restricted to
            the fitted pixels).
    """

    label: str
    options: Options
    prepared: Prepared

    @property
    def observed(self) -> np.ndarray:
        return self.prepared.inputs.observed

    @property
    def mask(self) -> np.ndarray:
        """The fitted pixels (bool (slow, fast))."""
        return self.prepared.choice.mask

    @property
    def start(self) -> dict:
        return dict(self.prepared.start)

    @property
    def truth(self) -> dict | None:
        return self.prepared.inputs.truth

    @property
    def is_image(self) -> bool:
        return self.prepared.inputs.truth is None

    @property
    def symmetry(self) -> str:
        return self.prepared.inputs.symmetry or "triclinic"

    @property
    def fixed(self) -> tuple[str, ...]:
        return tuple(self.prepared.inputs.fixed)

    @property
    def free(self) -> tuple[str, ...] | None:
        """``--refine``'s names, else the problem's free groups (None for an image: whatever the stages name)."""
        if self.options.fit.refine:
            return tuple(self.options.fit.refine)
        default = self.prepared.inputs.free_default
        return None if default is None else tuple(default)

    def simulator(self, compile: bool | None) -> Simulator:
        """The prepared (restricted) simulator switched to compiled or eager (None: the environment decides,
        ``NANOBRAGG_DISABLE_COMPILE``; ``nbtorch.eager()`` wins); ``prepared.sim`` as nbtorch-refine's policy
        left it is the same object."""
        sim = self.prepared.sim
        sim.set_compile(*runtime.compile_policy("simulator", explicit=compile))
        return sim

    def refine_kwargs(self) -> dict:
        """The keyword arguments of :func:`refine.refine` after the simulator and the image: nbtorch-refine's own
        (:func:`refine.modes.single.plan_arguments`)."""
        return plan_arguments(self.options, self.prepared)


def load_workload(options: Options, say: Callable[..., None] = print) -> Workload:
    """:func:`refine.modes.single.prepare` on ``options``; ``say`` prints its notes.  Bad input raises
    :class:`InputError` before anything is written."""
    prepared = prepare(options, say)
    label = (options.image.image if options.image.image else
             f"{options.model.problem} ({options.model.size}x{options.model.size})")
    return Workload(label=str(label), options=options, prepared=prepared)


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


# ------------------------------------------------------------------------------ options -> --config TOML
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else
                                                        ("inf" if value > 0 else "-inf"))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def _option_lines(options: Options, keep: Sequence[str] = ()) -> list[str]:
    """``key = value`` of every option that differs from nbtorch-refine's default, and of those named in ``keep``
    (field names) unless None; output files left out."""
    defaults = Options()
    lines = []
    for group in GROUP_TITLES:
        ours, theirs = getattr(options, group), getattr(defaults, group)
        for f in dataclasses.fields(ours):
            value = getattr(ours, f.name)
            skip = (f.name in OUTPUT_PATHS or f.name in ("config", "f_column", "stage_tables")
                    or (f.name == "size" and not options.model.problem))
            if skip or value is None or (value == getattr(theirs, f.name) and f.name not in keep):
                continue
            if f.name == "parallax":  # --no-parallax
                lines.append("no-parallax = true")
            elif f.name == "compile":  # --compile / --no-compile
                lines.append("compile = true" if value else "no-compile = true")
            else:
                lines.append(f"{f.name.replace('_', '-')} = {_toml_value(value)}")
    return lines


def refine_config_toml(options: Options, header: Sequence[str], out: str, keep: Sequence[str] = ()) -> str:
    """``options`` as an ``nbtorch-refine --config`` file (``# header`` lines first, results to ``out``): every
    option that differs from the default (or is named in ``keep``) by its long name, the ``[[stages]]`` tables
    last."""
    lines = [f"# {h}" for h in header] + _option_lines(options, keep) + [f"out = {_toml_value(out)}"]
    for table in options.fit.stage_tables or ():
        lines += ["", "[[stages]]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"
