"""What one still says about the cell when the detector distance is held: the cell over the distance.

A still's spots sit at ``r = D tan 2theta`` from the beam, with ``sin theta = lambda / 2d``: a cell ``k`` times
larger at a distance ``k`` times longer moves every spot by less than a pixel up to the resolution where
``tan 2theta`` stops being ``2 theta`` (on the thaumatin still the correlation of the distance with ``a`` is
+0.99).  A cell refined with the distance held fixed therefore rests on the distance: what the still measures
is ``cell / distance`` (Å per mm), and a 1 % error in the header's distance is a 1 % error in the cell.

:func:`cell_distance_note` gives, for a refinement of a measured image that refined cell lengths and held the
distance, that ratio and the ways out (``docs/esds-and-fit.md``): refine the distance (its esd
then carries the degeneracy into the cell's), share it between stills (``--joint --shared cell,distance``,
which also takes the stills' cells from their common distance), or restrain it (``--prior distance=MEAN:SIGMA``).
"""

from __future__ import annotations

from typing import Mapping

from refine.fitting.parameters import split_group_change

__all__ = ["cell_distance_note", "distance_refined", "note_line", "CELL_LENGTHS"]

CELL_LENGTHS = ("cell_a", "cell_b", "cell_c")


def cell_distance_note(params: Mapping[str, float], free: tuple[str, ...] | list[str]) -> dict | None:
    """``{"distance_mm", "distance_refined": False, "cell_per_distance": {cell_x: Å/mm}}`` when cell lengths were
    refined and the distance was not (None otherwise).  A multi-panel detector's panel groups refine their
    distances as ``distance_g<k>`` (``nbtorch-refine --panel-groups``): any of them counts as the distance refined."""
    if distance_refined(free) or not any(n in free for n in CELL_LENGTHS):
        return None
    distance = float(params["distance"])
    ratios = {n: float(params[n]) / distance for n in CELL_LENGTHS if n in free or n in params}
    return {"distance_mm": distance, "distance_refined": False, "cell_per_distance": ratios}


def distance_refined(free: tuple[str, ...] | list[str]) -> bool:
    """Whether ``free`` refines the detector distance: ``distance`` or a panel group's ``distance_g<k>``."""
    return any(n == "distance" or (split_group_change(n) or ("",))[0] == "distance" for n in free)


def note_line(note: Mapping) -> str:
    """The printed warning of a :func:`cell_distance_note`."""
    ratios = note["cell_per_distance"]
    shown = ", ".join(f"{n.split('_')[1]}/D {v:.6g}" for n, v in ratios.items() if n != "cell_b")
    return (f"the cell rests on the distance {note['distance_mm']:.6g} mm, which was held fixed: one still measures "
            f"cell / distance ({shown} A/mm), so a 1 % error in the distance is 1 % in the cell; refine the distance "
            "(add distance to --refine), share it between stills (--images ... --joint --shared cell,distance) or "
            "restrain it (--prior distance=MEAN:SIGMA) (docs/esds-and-fit.md)")
