"""Small detector image files for the tests, written with fabio's own writers (TIFF, mar345) or with fabio's
MarCCD header layout (fabio has no MarCCD writer).  Import only where fabio is installed."""

from __future__ import annotations

import struct

import fabio.mar345image
import fabio.marccdimage
import fabio.tifimage

PILATUS_LINES = ["# Detector: PILATUS3 6M, S/N 60-0119", "# Pixel_size 200e-6 m x 200e-6 m",
                 "# Silicon sensor, thickness 0.000450 m", "# Exposure_time 0.0400000 s", "# Wavelength 1.3000 A",
                 "# Detector_distance 0.08000 m", "# Beam_xy (21.50, 17.00) pixels", "# Start_angle 10.0000 deg.",
                 "# Angle_increment 0.1000 deg.", "# Detector_2theta 0.0000 deg.", "# Polarization 0.990",
                 "# Kappa 5.0000 deg."]


def write_tiff(path, image, description=None):
    # fabio's TIFF writer stores its header dict as "key=value" lines in ImageDescription: one key holding the
    # Pilatus lines, the "=" on a line of its own after them
    header = {"\r\n".join(description) + "\r\n": ""} if description else {}
    fabio.tifimage.TifImage(data=image, header=header).write(str(path))


def write_marccd(path, image, values):
    """A little-endian MarCCD file: TIFF header and IFD, the MAR frame header (fabio's layout) at byte 1024, the
    pixels at 4096."""
    slow, fast = image.shape
    depth = image.dtype.itemsize
    tags = [(256, 4, fast), (257, 4, slow), (258, 3, 8 * depth), (259, 3, 1), (262, 3, 1), (273, 4, 4096),
            (277, 3, 1), (278, 4, slow), (279, 4, image.nbytes), (339, 3, 1)]
    ifd = struct.pack("<H", len(tags)) + b"".join(
        struct.pack("<HHII", t, kind, 1, v) if kind == 4 else struct.pack("<HHIHH", t, kind, 1, v, 0)
        for t, kind, v in tags) + struct.pack("<I", 0)
    fields = {"header_byte_order": 1234, "data_byte_order": 1234, "nfast": fast, "nslow": slow, "depth": depth,
              "nimages": 1, **values}
    names, codes = fabio.marccdimage.HEADER_NAMES, fabio.marccdimage.HEADER_FORMAT
    frame = struct.pack("<" + codes, *(fields.get(n.split("[")[0], b"\x00" if c == "c" else 0)
                                       for n, c in zip(names, codes)))
    path.write_bytes((b"II*\x00" + struct.pack("<I", 8) + ifd).ljust(1024, b"\x00") + frame
                     + image.astype("<" + image.dtype.str[1:]).tobytes())


MARCCD = {"xtal_to_detector": 80000, "beam_x": 21500, "beam_y": 17000, "pixelsize_x": 200000, "pixelsize_y": 200000,
          "source_wavelength": 130000, "saturated_value": 3900, "rotation_axis": 4, "start_phi": 10000,
          "end_phi": 10100, "rotation_range": 100, "start_omega": 3000, "start_twotheta": 0, "exposure_time": 1000,
          "mean_bias": 10000, "detector_rotx": 500}


def write_mar345(path, image, extra=None):
    header = {"DISTANCE": "80.0", "WAVELENGTH": "1.3", "PIXEL_LENGTH": "200", "PIXEL_HEIGHT": "200",
              "PHI_START": "10.000", "PHI_END": "10.100", "PHI_OSC": "1", "OMEGA_START": "0", "OMEGA_END": "0",
              "OMEGA_OSC": "0", "CHI": "0", "TWOTHETA": "0", "CENTER_X": "21.5", "CENTER_Y": "17.0", "MODE": "TIME",
              "TIME": "60.0", "GAIN": "1.0", "FORMAT_TYPE": "PCK", **(extra or {})}
    writer = fabio.mar345image.Mar345Image(data=image, header=header)
    writer.byteorder = "<"  # fabio 2026.6's default "|" is refused by its own writer
    writer.write(str(path))
