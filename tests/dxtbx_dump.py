"""Run by a Python that has DIALS' dxtbx (``dials.python``, or any environment where ``import dxtbx`` works), not
by the project's: read each ``.expt`` given on the command line with dxtbx's own
``ExperimentListFactory.from_json_file`` and print, as one JSON document, what dxtbx made of every experiment
(beam, the panels, crystal, goniometer, scan, the detector hierarchy).  With ``--rewrite IN OUT`` it first
has dxtbx write what it read of IN to OUT (``ExperimentList.as_file``) and describes OUT.  Used by
``test_dials_geometry.py::test_dxtbx_reads_the_expt_files_nbtorch_writes`` and
``test_multi_panel_dials.py::test_dxtbx_reads_the_multi_panel_expt``."""

import json
import sys


def _vec(v):
    return [float(x) for x in v]


def _node(node):
    """A detector hierarchy node as dxtbx holds it: name, frame local to its parent, children or panel index."""
    rec = {"name": node.get_name(), "fast_axis": _vec(node.get_local_fast_axis()),
           "slow_axis": _vec(node.get_local_slow_axis()), "origin": _vec(node.get_local_origin())}
    if node.is_panel():
        rec["panel"] = int(node.index())
    else:
        rec["children"] = [_node(child) for child in node.children()]
    return rec


def dump(path):
    from dxtbx.model.experiment_list import ExperimentListFactory

    experiments = ExperimentListFactory.from_json_file(path, check_format=False)
    out = []
    for e in experiments:
        rec = {"wavelength": e.beam.get_wavelength(), "s0": _vec(e.beam.get_s0()),
               "direction": _vec(e.beam.get_sample_to_source_direction()),
               "panels": [{"origin": _vec(p.get_origin()), "fast_axis": _vec(p.get_fast_axis()),
                           "slow_axis": _vec(p.get_slow_axis()), "pixel_size": _vec(p.get_pixel_size()),
                           "image_size": [int(n) for n in p.get_image_size()],
                           "trusted_range": _vec(p.get_trusted_range()), "distance": p.get_distance()}
                          for p in e.detector],
               "real_space": [_vec(v) for v in e.crystal.get_real_space_vectors()],
               "unit_cell": _vec(e.crystal.get_unit_cell().parameters()),
               "hall": e.crystal.get_space_group().type().hall_symbol(),
               "goniometer": None if e.goniometer is None else _vec(e.goniometer.get_rotation_axis()),
               "scan": None if e.scan is None else {"oscillation": _vec(e.scan.get_oscillation()),
                                                   "image_range": [int(i) for i in e.scan.get_image_range()]},
               "hierarchy": _node(e.detector.hierarchy())}
        out.append(rec)
    return out


def rewrite(path, out):
    """dxtbx's own writer: read ``path`` and write the experiments back to ``out`` (ExperimentList.as_file)."""
    from dxtbx.model.experiment_list import ExperimentListFactory

    ExperimentListFactory.from_json_file(path, check_format=False).as_file(out)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--rewrite"]:  # --rewrite IN OUT: dxtbx writes what it read (the round trip's return leg)
        rewrite(args[1], args[2])
        args = [args[2]]
    print(json.dumps({path: dump(path) for path in args}))
