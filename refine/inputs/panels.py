"""``nbtorch-refine --expt`` with a multi-panel DIALS detector: the panels' simulator, the image and the
``--refl`` spots in its stacked layout, the panel groups of ``--panel-groups``, and ``--expt-out``.

Stacked layout (:class:`nbtorch.geometry.panels.PanelLayout`): panel ``i``'s pixel (slow ``j``, fast ``k``) is pixel
(``i * rows + j``, ``k``) of the stacked image, ``rows`` the tallest panel.  An image is taken as

* already stacked (``N * rows`` x ``cols`` pixels, e.g. written by ``nbtorch`` itself),
* ``N`` equal blocks along the slow axis (checked panel by panel next),
* a whole Pilatus or Eiger detector (modules and gaps, :mod:`nbtorch.io.modules`) cut into its modules row by
  row, when the detector has one panel per module,
* the file's own panels, in the file's order: the arrays or array sections of a multi-array CBF, the
  ``NXdetector_module`` groups of an NXmx file (:mod:`nbtorch.io.panel_images`),

and each panel's size is checked against the detector's (:func:`nbtorch.dials.panels.check_image_panels`).
The ``.refl`` positions ``xyzobs.px.value`` are panel pixels; its ``panel`` column says which panel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nbtorch.errors import InputError

if TYPE_CHECKING:  # types only
    from refine.inputs.measurement import DialsFiles

__all__ = ["panel_count", "panel_configs", "stacked_image", "panel_groups", "refl_panel_spots", "write_panels_expt"]


def panel_count(dials: DialsFiles | None) -> int:
    """How many panels the ``--expt`` detector has (1 without ``--expt``)."""
    return len(dials.experiment().panels) if dials is not None and dials.expt else 1


def panel_configs(dials: DialsFiles, tokens: list[str], dtype: str):
    """``(configs, names)``: each panel's configuration, its flags from the experiment
    (:func:`nbtorch.dials.panels.panel_flags`) followed by ``tokens``' flags after panel 0's (the profile's
    crystal model and ``--model``)."""
    from nbtorch import config_from_args
    from nbtorch.dials.panels import panel_flags

    from refine.inputs.dials import image_index

    exp = dials.experiment()
    flags = panel_flags(exp, image_index(dials))
    extra = list(tokens[len(flags[0]):])
    configs = []
    for i, f in enumerate(flags):
        try:
            configs.append(config_from_args(f + extra).replace(dtype=dtype))
        except InputError as exc:
            raise InputError(f"--model: panel {i}: {exc}") from None
    return configs, [str(p.get("name") or f"panel{i}") for i, p in enumerate(exp.panels)]


def _panels_of(image: np.ndarray, layout, boxes=None) -> list[np.ndarray]:
    """The image's panels (see the module docstring), not yet checked against the detector."""
    from nbtorch.io.modules import module_grid

    if boxes:  # the file's own panels (multi-array CBF, NXmx modules)
        return [image[y0:y0 + h, x0:x0 + w] for _, y0, x0, h, w in boxes]
    n, rows = len(layout.panels), layout.rows
    if image.shape == layout.shape:
        return [layout.panel_image(image, i) for i in range(n)]
    for family in ("pilatus", "eiger"):
        try:
            grid = module_grid(family, image.shape)
        except InputError:
            continue
        return [image[y0:y0 + h, x0:x0 + w] for x0, y0, w, h in grid]
    if image.shape[0] % n == 0 and image.shape[0] // n <= rows:  # equal blocks of another height: checked next
        h = image.shape[0] // n
        return [image[i * h:(i + 1) * h] for i in range(n)]
    return [image]


def stacked_image(dials: DialsFiles, layout, image: np.ndarray, mask: np.ndarray,
                  boxes=None) -> tuple[np.ndarray, np.ndarray]:
    """``(image, mask)`` of ``--image`` in the stacked ``layout`` (:class:`nbtorch.geometry.panels.PanelLayout`; block
    pixels outside a panel: 0 and masked).  ``boxes``: the file's own panels, ``(name, y0, x0, height,
    width)`` each (``header["panel_boxes"]`` of a multi-array CBF or an NXmx file of modules,
    :mod:`nbtorch.io.panel_images`), matched to the detector's panels in order.

    Raises:
        InputError: the image's panels do not match the detector's (one line naming the panel and the sizes).
    """
    from nbtorch.dials.panels import check_image_panels

    exp = dials.experiment()
    parts, masks = _panels_of(np.asarray(image), layout, boxes), _panels_of(np.asarray(mask), layout, boxes)
    try:
        check_image_panels(exp, [tuple(p.shape) for p in parts], what=f"--image {dials.image}")
    except InputError as exc:
        raise InputError(f"--expt {exc}") from None
    out, keep = np.zeros(layout.shape), np.zeros(layout.shape, dtype=bool)
    for i, (part, m) in enumerate(zip(parts, masks)):
        r0 = i * layout.rows
        out[r0:r0 + part.shape[0], :part.shape[1]] = part
        keep[r0:r0 + part.shape[0], :part.shape[1]] = m
    return out, keep


def panel_groups(dials: DialsFiles, level: int | None) -> tuple[list[tuple[int, ...]], list[str]]:
    """``(groups, labels)`` of ``--panel-groups LEVEL``: the groups of that level of the detector's hierarchy
    (0 the whole detector, the last the panels; :func:`nbtorch.dials.panels.hierarchy_groups`); default 0."""
    from nbtorch.dials.panels import hierarchy_groups

    levels = hierarchy_groups(dials.experiment().detector)
    level = 0 if level is None else level
    if not 0 <= level < len(levels):
        raise InputError(f"--panel-groups {level}: the detector's hierarchy has levels 0..{len(levels) - 1} "
                         f"(0: the whole detector, {len(levels) - 1}: each panel)")
    return [members for _, members in levels[level]], [name for name, _ in levels[level]]


def refl_panel_spots(dials: DialsFiles, layout) -> np.ndarray:
    """``(n, 3)`` observed spots of ``--refl`` (x fast, y slow in stacked pixels, z frame): each row's panel
    pixels moved into its panel's block (the ``panel`` column; rows as :func:`refine.inputs.dials.refl_spots`)."""
    from nbtorch.io.dials import read_refl

    from refine.inputs.dials import observed_rows

    path = dials.refl
    try:
        cols = read_refl(path, ("xyzobs.px.value", "panel"), experiment_id=dials.index,
                         optional=("flags",))
    except InputError as exc:
        raise InputError(f"--refl {exc}") from None
    keep = observed_rows(path, cols)
    xyz, panel = cols["xyzobs.px.value"][keep].astype(np.float64), cols["panel"][keep].astype(int).reshape(-1)
    n = len(layout.panels)
    bad = (panel < 0) | (panel >= n)
    if bad.any():
        raise InputError(f"--refl {path}: a spot on panel {int(panel[bad][0])}, but the detector has panels 0..{n - 1}")
    if not len(xyz):
        raise InputError(f"--refl {path}: no observed spots of experiment {dials.index}")
    xyz[:, 1] += panel * layout.rows
    return np.ascontiguousarray(xyz)


def write_panels_expt(dials: DialsFiles, path: str, sim, params) -> None:
    """Write ``path`` (``--expt-out``) of a multi-panel run: every panel at its refined values
    (:func:`nbtorch.dials.panels.refined_panels_document`)."""
    from nbtorch.dials.panels import refined_panels_document
    from nbtorch.io.dials import write_expt

    from refine.inputs.dials import image_index

    doc = refined_panels_document(dials.experiment(), sim, dict(params), image_index(dials))
    write_expt(path, doc)
