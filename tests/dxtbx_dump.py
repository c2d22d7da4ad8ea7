"""Run by a Python that has DIALS' dxtbx (``dials.python``, or any environment where ``import dxtbx`` works), not
by the project's: read each ``.expt`` given on the command line with dxtbx's own
``ExperimentListFactory.from_json_file`` and print, as one JSON document, what dxtbx made of every experiment
(beam, the panels, crystal, goniometer, scan).  Used by ``test_dials_geometry.py::test_dxtbx_reads_the_expt_files_nbtorch_writes``."""

import json
import sys


def _vec(v):
    return [float(x) for x in v]


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
                                                   "image_range": [int(i) for i in e.scan.get_image_range()]}}
        out.append(rec)
    return out


if __name__ == "__main__":
    print(json.dumps({path: dump(path) for path in sys.argv[1:]}))
