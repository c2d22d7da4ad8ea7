"""SimulationConfig: every nanoBragg setting, in the units of its command-line flag.

A field left at ``None`` means "not given": the C program's automatic rule
applies (see :mod:`nbtorch.rules.resolve`, which resolves the config into tensors).
Units are in the field names (``_mm``, ``_A``, ``_deg``, ``_mrad``, ``_um``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

CONVENTIONS = ("mosflm", "xds", "dials", "adxv", "denzo", "custom")
SHAPES = ("square", "round", "gauss", "tophat", "gauss_aniso")
#: the shape whose size is the symmetric matrix N (-Na -Nb -Nc and the off-diagonal -Nd -Ne -Nf)
ANISOTROPIC_SHAPE = "gauss_aniso"


@dataclass
class SimulationConfig:
    """All inputs of a simulation (flag units; ``None`` = C default rule)."""

    # crystal
    cell: tuple[float, float, float, float, float, float] | None = None  # A, deg
    mat_file: str | None = None
    misset_deg: tuple[float, float, float] | None = None
    misset_random: bool = False
    misset_seed: int | None = None
    N_a: float = 1.0
    N_b: float = 1.0
    N_c: float = 1.0
    N_d: float = 0.0  # off-diagonal sizes (unit cells) of -gauss_aniso_xtal: a-b, b-c, a-c
    N_e: float = 0.0
    N_f: float = 0.0
    shape: str = "square"
    fudge: float = 1.0
    mosaic_spread_deg: float | None = None
    mosaic_domains: int | None = None
    mosaic_seed: int | None = None  # as given to -mosaic_seed (C stores -value)
    #: -mosaic_model: gaussian or ball (even, deterministic domain sets) or random (the C's draw); None: ball in
    #: spec mode, random with -c_parity or -mosaic_seed (nbtorch.rules.resolve.mosaic_model_of)
    mosaic_model: str | None = None
    #: -mosaic_turn: the even set turned by its K-th fixed rotation (nbtorch.physics.mosaic.mosaic_set_turn; 0/None: as built)
    mosaic_turn: int | None = None
    #: -mosaic_abc: one spread per crystal axis (deg; spec mode only, nbtorch.physics.mosaic); None = isotropic
    mosaic_spread_abc_deg: tuple[float, float, float] | None = None
    phi_deg: float = 0.0
    osc_deg: float | None = None
    phistep_deg: float | None = None
    phisteps: int | None = None
    spindle_axis: tuple[float, float, float] | None = None
    # structure factors
    hkl_file: str | None = None
    hkl_column: str | None = None  # amplitude column of an MTZ / mmCIF -hkl file
    hkl_dmin_A: float | None = None  # resolution of F computed from a model -hkl file (default: the detector's)
    dump_file: str | None = None  # -dump: with -hkl write the F cache here, without -hkl read F from it
    default_F: float = 0.0
    interpolate: bool | None = None
    # beam
    wavelength_A: float = 1.0
    dispersion_pct: float | None = None
    dispsteps: int | None = None
    hdivrange_mrad: float | None = None
    vdivrange_mrad: float | None = None
    hdivstep_mrad: float | None = None
    vdivstep_mrad: float | None = None
    hdivsteps: int | None = None
    vdivsteps: int | None = None
    round_div: bool = True
    source_file: str | None = None
    source_distance_mm: float = 10000.0
    polarization: float = 0.0  # Kahn factor K
    nopolar: bool = False
    polar_vector: tuple[float, float, float] | None = None
    beam_vector: tuple[float, float, float] | None = None
    fluence: float | None = None  # photons/m^2
    flux: float = 0.0  # photons/s
    exposure_s: float = 1.0
    beamsize_mm: float = 0.1
    # detector
    convention: str = "mosflm"
    pivot: str | None = None  # the pivot the flags selected (C rules; the convention may force one)
    fdet_vector: tuple[float, float, float] | None = None
    sdet_vector: tuple[float, float, float] | None = None
    odet_vector: tuple[float, float, float] | None = None
    twotheta_axis: tuple[float, float, float] | None = None
    pix0_vector_m: tuple[float, float, float] | None = None
    distance_mm: float = 100.0
    close_distance_mm: float | None = None
    Xbeam_mm: float | None = None
    Ybeam_mm: float | None = None
    Xclose_mm: float | None = None
    Yclose_mm: float | None = None
    ORGX: float | None = None
    ORGY: float | None = None
    detector_rotx_deg: float = 0.0
    detector_roty_deg: float = 0.0
    detector_rotz_deg: float = 0.0
    twotheta_deg: float = 0.0
    pixel_mm: float = 0.1
    fpixels: int | None = None
    spixels: int | None = None
    detsize_f_mm: float = 102.4
    detsize_s_mm: float = 102.4
    point_pixel: bool = False
    curved_det: bool = False
    oversample: int | None = None
    oversample_thick: bool = False
    oversample_polar: bool = False
    oversample_omega: bool = False
    detector_thick_um: float = 0.0
    detector_abs_um: float | None = None  # attenuation depth; None = thickness; inf/0 = off
    detector_thicksteps: int | None = None
    roi: tuple[int, int, int, int] | None = None  # xmin xmax ymin ymax, inclusive
    dmin_A: float = 0.0
    water_um: float = 0.0
    img_file: str | None = None  # -img: SMV whose header seeded the detector settings (read at parse time)
    mask_file: str | None = None  # -mask: SMV whose zero pixels are skipped (header read at parse time too)
    # outputs and run control (used by the CLI)
    floatfile: str | None = None
    intfile: str | None = None
    noisefile: str | None = None
    pgmfile: str | None = None
    h5file: str | None = None
    scale: float = 0.0
    pgmscale: float = 0.0
    adc: float = 40.0
    seed: int | None = None
    nonoise: bool = False
    nopgm: bool = False
    progress: bool = True
    printout: bool = False
    printout_pixel: tuple[int, int] | None = None
    c_parity: bool = False
    phi_carryover: str | None = None  # -phi_carryover_mode spec|c-parity; None = follow c_parity
    compile: bool | None = None  # -compile / -nocompile; None = size rule (CLI) or environment
    dtype: str = "float64"
    device: str = "cpu"
    # flags accepted for compatibility that change nothing we compute
    ignored_flags: tuple[str, ...] = field(default_factory=tuple)
    #: field name -> the command-line flag that last set it (``-N`` for ``N_a``, ``-detpixels`` for
    #: ``fpixels``...), so that errors name the flag the user typed; filled by
    #: :func:`nbtorch.cli.args.config_from_args`, empty for configs built in Python
    flags: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def flag_for(self, name: str, default: str) -> str:
        """The flag that set field ``name`` on the command line, else ``default``."""
        return self.flags.get(name, default)

    def model_files(self) -> list[tuple[str, str]]:
        """``(flag, path)`` of every file the flags name: ``-hkl -mat -sourcefile -img -mask -dump``
        (those given; with ``-hkl``, ``-dump`` is the cache the ``nbtorch`` command writes)."""
        named = (("-hkl", self.hkl_file), ("-mat", self.mat_file), ("-sourcefile", self.source_file),
                 ("-img", self.img_file), ("-mask", self.mask_file), ("-dump", self.dump_file))
        return [(flag, path) for flag, path in named if path]

    def replace(self, **changes) -> "SimulationConfig":
        """A copy with some fields changed."""
        return replace(self, **changes)
