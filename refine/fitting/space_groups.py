"""Space groups by crystal system: what ``--symmetry`` accepts.

:func:`crystal_system` maps ``--symmetry`` (a crystal system such as ``tetragonal``, or a space-group symbol such
as ``P41212``, spaces and underscores ignored) to the crystal system whose cell constraints
(:data:`refine.fitting.parameters.SYMMETRIES`) a refinement applies.  :data:`SPACE_GROUP_SYSTEMS` lists the
symbols it knows (a few common ones; any crystal-system name works).
"""

from __future__ import annotations

from nbtorch.errors import InputError
from refine.fitting.parameters import SYMMETRIES

__all__ = ["SPACE_GROUP_SYSTEMS", "crystal_system"]

#: space-group names accepted by --symmetry, mapped to crystal systems (a few common ones; any system name works)
SPACE_GROUP_SYSTEMS = {
    "P1": "triclinic", "P2": "monoclinic", "P21": "monoclinic", "C2": "monoclinic",
    "P222": "orthorhombic", "P212121": "orthorhombic", "C2221": "orthorhombic", "I222": "orthorhombic",
    "P4": "tetragonal", "P41": "tetragonal", "P42": "tetragonal", "P43": "tetragonal", "I4": "tetragonal",
    "P422": "tetragonal", "P4212": "tetragonal", "P4122": "tetragonal", "P41212": "tetragonal",
    "P4222": "tetragonal", "P42212": "tetragonal", "P4322": "tetragonal", "P43212": "tetragonal",
    "I422": "tetragonal", "I4122": "tetragonal",
    "P3": "trigonal", "P31": "trigonal", "P32": "trigonal", "P321": "trigonal", "P3121": "trigonal",
    "P3221": "trigonal", "P312": "trigonal", "R3": "rhombohedral", "R32": "rhombohedral",
    "P6": "hexagonal", "P61": "hexagonal", "P65": "hexagonal", "P622": "hexagonal", "P6122": "hexagonal",
    "P6522": "hexagonal", "P23": "cubic", "P213": "cubic", "I23": "cubic", "F23": "cubic", "P432": "cubic",
    "P4132": "cubic", "P4332": "cubic", "I432": "cubic", "F432": "cubic",
}


def crystal_system(name: str | None) -> str | None:
    """``--symmetry``: a crystal system name, or a space-group symbol mapped to its system."""
    if name is None:
        return None
    key = name.strip()
    if key.lower() in SYMMETRIES:
        return key.lower()
    compact = key.replace(" ", "").replace("_", "").upper()
    if compact in SPACE_GROUP_SYSTEMS:
        return SPACE_GROUP_SYSTEMS[compact]
    raise InputError(f"--symmetry: unknown crystal system or space group {name!r}; "
                     f"crystal systems: {', '.join(SYMMETRIES)}")




def check_subgroup(given: str, flag: str, experiment: str) -> None:
    """Refuse, in one line, the amplitudes' space group ``given`` (by ``flag``) where its point group or lattice
    centring is not within the experiment's space group ``experiment``'s: it would tie reflections that the indexed
    crystal does not relate.  Screw axes and glides may differ (an indexing space group often has none: ``P 4 2 2``
    then ``P41212``).  Both are symbols gemmi knows."""
    import gemmi  # noqa: PLC0415 - the caller has checked both symbols with gemmi

    def parts(name: str) -> tuple[gemmi.SpaceGroup, set, set]:
        group = gemmi.SpaceGroup(name)
        ops = group.operations()
        return group, {tuple(map(tuple, op.rot)) for op in ops.sym_ops}, {tuple(c) for c in ops.cen_ops}

    (g, rot, cen), (e, rot_e, cen_e) = parts(given), parts(experiment)
    if not (rot <= rot_e and cen <= cen_e):
        raise InputError(f"{flag} {given}: contradicts the --expt crystal's space group {experiment} (point group "
                         f"{g.point_group_hm()}, lattice {g.hm[0]}: not within {e.point_group_hm()}, {e.hm[0]}); give "
                         f"{experiment} or one of its subgroups")
