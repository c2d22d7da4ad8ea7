"""Simulator: a thin ``nn.Module`` that owns the canonical parameters and calls the physics.

``Simulator(config)(**overrides)`` returns the image (slow, fast) in photons per
pixel.  Overrides replace canonical parameters for one call by name (see
:data:`nbtorch.parameters.PARAMETER_NAMES`, units in :mod:`nbtorch.parameters`) and may be
tensors that require grad; ``F_grid`` replaces the structure-factor table (entries
missing from the HKL file always follow ``default_F``), and ``orient_x, orient_y,
orient_z`` (deg, default 0) add a small crystal rotation about the lab axes on
top of the misset orientation (what a refinement of the orientation moves).
Pixels outside ``-roi`` are zero, as in the C program.

A detector of several panels (:meth:`Simulator.from_panels`, :mod:`nbtorch.geometry.panels`) renders all its
panels in one call, stacked along the slow axis; each panel's geometry has its own canonical names
(``distance_p3`` ...), and each panel's pixels are those of the single-panel simulator of its config.

The image itself, tile by tile through the eager or compiled kernel, is :class:`nbtorch.rendering.Rendering`'s
(``render``, ``render_pixels``), which the Simulator inherits.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import torch
from torch import Tensor, nn

from nbtorch.runtime import policy as runtime
from nbtorch.geometry.beam_centre import detector_offsets_m
from nbtorch.config import SimulationConfig
from nbtorch.diagnostics import DiagnosticsHooks
from nbtorch.errors import InputError
from nbtorch.physics.crystal import crystal_real_and_reciprocal
from nbtorch.physics.mosaic import anisotropic_mosaic_rotations, crystal_frame, isotropic_mosaic_rotations
from nbtorch.geometry.panels import PanelLayout, resolve_panels, split_panel_parameter
from nbtorch.physics.detector import DetectorGeometry, detector_geometry, stack_geometries
from nbtorch.physics.kernel import KernelInputs, KernelOptions
from nbtorch.physics.lattice import size_vector
from nbtorch.physics.rotation import rotation_matrix_axis_angle, rotation_matrix_xyz
from nbtorch.sampling.beam_sources import WIDTH_NAMES, offset_change, source_directions
from nbtorch.parameters import (
    MOSAIC_AXIS_NAMES, ORIENTATION_DELTAS, PARAMETER_NAMES, SIMULATOR_NAMES, SIZE_DIAGONAL, SIZE_OFF_DIAGONAL,
)
from nbtorch.rendering import Rendering, phi_angles
from nbtorch.rules.resolve import Setup, resolve, with_mosaic_domains

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


_NO_SPREAD = {
    "dispersion": "the model has one wavelength (or a -sourcefile); a spectral width needs -dispersion > 0 "
                  "(and -dispsteps > 1) in the model",
    "divergence_h": "the model's sources do not spread horizontally (or come from a -sourcefile); a divergence "
                    "needs -hdivrange (or -divergence) > 0 and -hdivsteps (or -divsteps) > 1 in the model",
    "divergence_v": "the model's sources do not spread vertically (or come from a -sourcefile); a divergence "
                    "needs -vdivrange (or -divergence) > 0 and -vdivsteps (or -divsteps) > 1 in the model",
}


def _same_value(value, buffer) -> bool:
    """True when an override equals the simulator's own value (to float32 rounding): a multi-panel simulator
    ignores such a plain detector name (a caller passing every canonical name at its start)."""
    a, b = _host_float(value), _host_float(buffer)
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def _host_float(value) -> float:
    """``value`` as a Python float: a plain number as it is (a refinement's fixed values, at every evaluation:
    no tensor made and read back), a tensor read from its device."""
    return float(value.detach()) if isinstance(value, Tensor) else float(value)


#: plain values a simulator keeps as device tensors (:meth:`Simulator._constant`)
MAX_CONSTANTS = 4096


def _has_storage(t: Tensor) -> bool:
    """Whether ``t`` is a plain tensor with its own storage (not a ``torch.func`` wrapper or a fake tensor)."""
    try:
        t.data_ptr()
    except RuntimeError:
        return False
    return True


def default_tile_evaluations(device: torch.device | str) -> int:
    """A simulator's evaluations per kernel tile unless chosen: 2^20 on a CPU (tiles that stay in its caches),
    2^25 on a GPU, where each tile costs its kernels' launches and the glue around them whatever its size, so an
    image of up to 2^25 evaluations (heavy 1024^2: 31.5 million) is one tile (docs/performance.md)."""
    return 1 << 25 if torch.device(device).type == "cuda" else 1 << 20


class Simulator(Rendering, nn.Module):
    """nanoBragg as a differentiable module.

    Arguments:
        config: a :class:`SimulationConfig` (e.g. from :func:`nbtorch.config_from_args`).
        dtype: ``torch.float64`` (default, parity) or ``torch.float32``.
        device: ``"cpu"`` or ``"cuda[:N]"``.
        max_evals_per_tile: memory bound: pixels are processed in tiles of at most
            this many (pixel x sub-pixel x source x phi x mosaic) evaluations; default
            :func:`default_tile_evaluations` of the device (2^20 on a CPU, 2^25 on a GPU).
        compile: ``True``/``False`` force or forbid ``torch.compile``; ``None``
            follows ``NANOBRAGG_DISABLE_COMPILE`` / ``NANOBRAG_DISABLE_COMPILE``
            (see :mod:`nbtorch.runtime.policy`).  Inside ``nbtorch.eager()`` it is always eager.
        kernel_dtype: the dtype of the per-pixel kernel (positions, scattering vectors,
            the orientation sum and their backward); default ``dtype``.  With
            ``dtype=float64, kernel_dtype=float32`` the parameters, the crystal and
            detector geometry and the returned pixels are float64 and only each tile's
            kernel runs in float32 (its sums over one tile's pixels and orientations in
            float32; the pixels, and the gradients summed over tiles, in float64).

    Attributes:
        compile_mode: ``"compiled"`` or ``"eager"`` (what actually runs).
        compile_reason: why (the rule that chose it, or the compile error).
        diagnostics: :class:`~nbtorch.diagnostics.DiagnosticsHooks`; subscribers get
            each render's diagnostics tensors, outside the compiled region.
    """

    def __init__(
        self,
        config: SimulationConfig,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        max_evals_per_tile: int | None = None,
        compile: bool | None = None,
        kernel_dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__()
        use_compile, self.compile_reason = runtime.compile_policy("simulator", explicit=compile)
        self.compile_mode = "compiled" if use_compile else "eager"
        self.diagnostics = DiagnosticsHooks()
        if isinstance(dtype, str):
            dtype = _DTYPES[dtype]
        self._setup: Setup = resolve(config)
        self._model_mask = self._setup.pixel_mask  # the model's own -mask, which every restriction keeps
        self.config = config
        self.dtype = dtype or _DTYPES[config.dtype]
        if isinstance(kernel_dtype, str):
            if kernel_dtype not in _DTYPES:
                raise InputError(f"kernel_dtype: expected one of {', '.join(_DTYPES)}, got {kernel_dtype!r}")
            kernel_dtype = _DTYPES[kernel_dtype]
        self.kernel_dtype = kernel_dtype or self.dtype
        dev = torch.device(device or config.device)
        self.max_evals_per_tile = int(max_evals_per_tile or default_tile_evaluations(dev))
        for name, value in self.setup.params.items():
            self.register_buffer(name, torch.tensor(value, dtype=torch.float64, device=dev))
        for name in ORIENTATION_DELTAS:
            self.register_buffer(name, torch.tensor(0.0, dtype=torch.float64, device=dev))
        s = self.setup
        if s.F_grid is not None:
            self.register_buffer("F_grid", torch.as_tensor(s.F_grid, dtype=torch.float64, device=dev))
        else:
            self.F_grid = None
        if s.F_present is not None and not bool(np.all(s.F_present)):
            self.register_buffer("F_present", torch.as_tensor(np.array(s.F_present), device=dev))
        else:
            self.F_present = None
        self.options = kernel_options(config, s)
        self.panel_layout: PanelLayout | None = None  # a multi-panel detector (from_panels)

    @classmethod
    def from_panels(cls, configs, names=None, **kwargs) -> "Simulator":
        """A simulator of a detector of several flat panels: panel ``i`` is the detector of ``configs[i]`` (a
        :class:`SimulationConfig`), the crystal, beam and sampling are shared (every config must give the
        same; :func:`nbtorch.geometry.panels.resolve_panels`); ``names`` labels the panels.  ``kwargs`` as the
        constructor.  The image is the panels stacked along the slow axis (:class:`nbtorch.geometry.panels.PanelLayout`),
        each panel's pixels those of ``Simulator(configs[i])``; the geometry of panel ``i`` is the
        canonical names ``<detector name>_p<i>`` (``distance_p0``, ``beam_x_p0`` ...)."""
        configs = list(configs)
        shared, layout = resolve_panels(configs, names)
        sim = cls(configs[0], **kwargs)
        for i, cfg in enumerate(configs[1:], start=1):
            if kernel_options(cfg, shared) != sim.options:
                raise InputError(f"panel {i}: its kernel options (polarization, point pixel, oversample_* "
                                 "flags) differ from panel 0's; the panels share them")
        rows, cols = layout.shape
        det = dataclasses.replace(shared.detector, spixels=rows, fpixels=cols, roi=(0, cols - 1, 0, rows - 1))
        sim._setup = dataclasses.replace(shared, detector=det, pixel_mask=layout.mask)
        sim._model_mask = sim._setup.pixel_mask
        sim.panel_layout = layout
        for name, value in layout.values().items():
            sim.register_buffer(name, torch.tensor(value, dtype=torch.float64, device=sim.device))
        return sim

    # ------------------------------------------------------------------------------
    @property
    def setup(self) -> Setup:
        """The resolved, frozen setup.  Read-only: a simulator is never edited from outside; a different set of
        pixels is another simulator (:meth:`restricted`)."""
        return self._setup

    def _shallow_copy(self) -> "Simulator":
        """A copy sharing this simulator's tensors and compiled kernels, with its own attribute and buffer tables
        (so that the caller may swap a setup or a buffer) and no pixel-index cache."""
        new = copy.copy(self)
        new.__dict__ = dict(self.__dict__)
        for table in ("_buffers", "_parameters", "_modules"):
            new.__dict__[table] = dict(self.__dict__[table])
        new.__dict__.pop("_pixel_cache", None)
        return new

    def restricted(self, pixels: np.ndarray) -> "Simulator":
        """A simulator that computes only the True pixels of ``pixels`` (bool (slow, fast), combined with the
        model's own ``-mask``, not with an earlier restriction); the others render as exactly 0.

        The copy shares this simulator's parameter buffers, structure factors and compiled kernels (the kernel
        cache, :func:`nbtorch.runtime.policy.compiled_kernel`, is keyed on what changes the graph: device, dtype, kernel
        options, tile size, sampling counts and the F table's shape, never on which pixels are simulated) and has
        its own pixel-index cache; ``self`` is unchanged.
        """
        mask = np.asarray(pixels, dtype=bool)
        if mask.shape != tuple(self.shape):
            raise InputError(f"pixel mask shape {mask.shape} does not match the detector {tuple(self.shape)}")
        old = self._model_mask
        new = self._shallow_copy()
        new._setup = dataclasses.replace(self._setup, pixel_mask=mask if old is None else (mask & old))
        return new

    def with_structure_factors(self, F_grid: np.ndarray, hkl_min) -> "Simulator":
        """A simulator whose structure-factor table is ``F_grid`` ((nh, nk, nl), F of ``hkl_min + index``; every
        entry listed, reflections outside follow ``default_F``), e.g. the table a refinement of the amplitudes
        edits (:mod:`refine.fitting.structure_factors`).  Pixels, parameters and kernel options are this simulator's;
        ``self`` is unchanged."""
        grid = np.asarray(F_grid, dtype=np.float64)
        lo = np.asarray(hkl_min, dtype=np.float64).reshape(3)
        if grid.ndim != 3 or not np.all(np.isfinite(grid)) or np.any(grid < 0):
            raise InputError(f"structure-factor table: expected a finite, non-negative 3-d array, got shape {grid.shape}")
        new = self._shallow_copy()
        sf = dataclasses.replace(self._setup.structure_factors, F_grid=grid, F_present=None, hkl_min=lo,
                                 hkl_max=lo + np.array(grid.shape) - 1)
        new._setup = dataclasses.replace(self._setup, structure_factors=sf)
        for name in ("F_grid", "F_present"):  # plain attributes (None) or buffers
            new.__dict__.pop(name, None)
            new._buffers.pop(name, None)
        new._buffers["F_grid"] = torch.as_tensor(grid, dtype=torch.float64, device=self.device)
        new.__dict__["F_present"] = None
        return new

    def with_mosaic_domains(self, count: int, part: int = 0, parts: int = 1) -> "Simulator":
        """This simulator with ``count`` mosaic domains of its own mosaic model (an even set of that count, or the
        random draw of that length), or with the ``part``-th of ``parts`` equal slices of them
        (:func:`nbtorch.rules.resolve.with_mosaic_domains`: the slices' mean image is the image of all ``count``, and a
        slice of this simulator's own count reuses its compiled kernel); pixels, parameters, structure factors and
        kernel options are this simulator's; ``self`` is unchanged."""
        new = self._shallow_copy()
        new._setup = dataclasses.replace(self._setup, sampling=with_mosaic_domains(
            self.config, self._setup.sampling, int(count), int(part), int(parts)))
        return new

    def sharing_structure_factors(self, other: "Simulator") -> "Simulator":
        """This simulator with ``other``'s structure-factor table in place of its own equal one (the same
        entries, listed entries and index range), so that many simulators of one crystal hold one copy (a joint
        refinement of many images, :mod:`refine.many.joint`); ``self`` when the tables differ, either has none, or
        they are already one.  ``self`` is unchanged."""
        a, b = self._setup.structure_factors, other.setup.structure_factors
        if a is b or a.F_grid is None or b.F_grid is None or a.F_grid is b.F_grid:
            return self
        same = (a.F_grid.shape == b.F_grid.shape and np.array_equal(a.hkl_min, b.hkl_min)
                and np.array_equal(a.F_grid, b.F_grid) and (a.F_present is None) == (b.F_present is None)
                and (a.F_present is None or np.array_equal(a.F_present, b.F_present))
                and a.interpolate == b.interpolate and a.dmin_A == b.dmin_A
                and self.F_grid is not None and other.F_grid is not None and self.device == other.device)
        if not same:
            return self
        new = self._shallow_copy()
        new._setup = dataclasses.replace(self._setup, structure_factors=b)
        new._buffers["F_grid"] = other.F_grid
        if self.F_present is not None:
            new._buffers["F_present"] = other.F_present
        return new

    @property
    def shape(self) -> tuple[int, int]:
        """Image shape (slow, fast)."""
        return (self.setup.spixels, self.setup.fpixels)

    @property
    def device(self) -> torch.device:
        return self.cell_a.device

    def _t(self, value) -> Tensor:
        """``value`` as a tensor of the simulator's dtype on its device: a tensor converted, plain data (a number,
        an array of the set-up) through :meth:`_constant`."""
        if isinstance(value, Tensor):
            return torch.as_tensor(value, dtype=self.dtype, device=self.device)
        return self._constant(value)

    def _constant(self, value) -> Tensor:
        """Plain data (a number or an array) as a tensor of the simulator's dtype on its device, made once per
        content, dtype and device and then reused (read-only: callers compute with it, never in place).  On a GPU
        making it is a host-to-device copy, which an evaluation captured into a CUDA graph may not contain
        (:mod:`nbtorch.runtime.cuda_graph`); reused, a refinement's fixed values and the set-up's axes cost
        nothing per evaluation.  A kept tensor is never dropped (a captured graph may read it); past
        :data:`MAX_CONSTANTS` values (a scan of plain values) new ones are made each time instead.  One made inside a
        ``torch.func`` transform (``jacfwd``: the esds, a joint run's preconditioner) is a wrapper without storage:
        it is not kept (a compiled kernel given it later fails, and the simulator would fall back to eager)."""
        data = np.asarray(value, dtype=np.float64)
        key = (data.shape, data.tobytes(), self.dtype, self.device)  # bytes: -0.0 and 0.0 stay apart
        held = self.__dict__.setdefault("_constants", {})
        tensor = held.get(key)
        if tensor is None:
            tensor = torch.as_tensor(data, dtype=self.dtype, device=self.device)
            if len(held) < MAX_CONSTANTS and _has_storage(tensor):
                held[key] = tensor
        return tensor

    def parameters_dict(self, **overrides) -> dict[str, Tensor]:
        """Canonical parameters for one call (buffers, replaced by overrides), in self.dtype."""
        names = self.parameter_names()
        unknown = set(overrides) - set(names) - {"F_grid"}
        if unknown:
            raise InputError(f"unknown parameter name(s): {', '.join(sorted(unknown))}; expected {', '.join(PARAMETER_NAMES)}"
                             + (" and the per-panel names <detector name>_p<i>" if self.panel_layout else ""))
        if self.panel_layout is not None:
            plain = sorted(n for n in overrides if split_panel_parameter(f"{n}_p0") is not None
                           and not _same_value(overrides[n], self._buffer_value(n)))
            if plain:
                raise InputError(f"{', '.join(plain)}: a multi-panel detector has per-panel geometry names "
                                 f"({plain[0]}_p0, {plain[0]}_p1, ...)")
        self._check_widths(overrides)
        out = {}
        for name in names:
            v = overrides.get(name, getattr(self, name))
            if isinstance(v, Tensor):
                v = v.to(device=self.device)
                out[name] = v.to(self.dtype) if v.dtype != self.dtype else v
            else:  # a plain number straight to self.dtype (through the default float32 it would lose digits)
                out[name] = self._t(v)
        return out

    def _buffer_value(self, name: str) -> float:
        """Buffer ``name`` as a Python float, read from its device once per buffer and version (a multi-panel
        simulator compares the plain geometry names of every evaluation with it: no device read each time)."""
        buffer = getattr(self, name)
        held = self.__dict__.setdefault("_host_values", {}).get(name)
        if held is None or held[0] is not buffer or held[1] != buffer._version:
            held = (buffer, buffer._version, _host_float(buffer))
            self._host_values[name] = held
        return held[2]

    def source_width_names(self) -> tuple[str, ...]:
        """The beam's width names (``dispersion``, ``divergence_h``, ``divergence_v``) whose sources spread along
        them (resolved width > 0): the widths that move the sources and may be changed or refined."""
        widths = self.setup.sampling.source_widths
        return tuple(n for n in WIDTH_NAMES if widths.get(n, 0.0) > 0.0)

    def _check_widths(self, overrides) -> None:
        """A width without spread (one source along it, or a ``-sourcefile``) changes nothing: refuse another value."""
        free = self.source_width_names()
        for name in WIDTH_NAMES:
            if name in overrides and name not in free and (value := _host_float(overrides[name])) != 0.0:
                raise InputError(f"{name} {value:g}: {_NO_SPREAD[name]}")

    def sources(self, p: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """``(incident (Q, 3), wavelength_A (Q,))`` of the sources at the widths and wavelength of ``p``.

        The sources' number and their places in units of each width are the resolved ones
        (:mod:`nbtorch.sampling.beam_sources`); each source's wavelength factor ``1 + offset`` and its two angles scale
        with ``dispersion`` (percent) and ``divergence_h``/``divergence_v`` (mrad), differentiably.  At the
        resolved widths the values are exactly the resolved ones.
        """
        s, t = self.setup.sampling, self._t
        widths = s.source_widths
        incident, factor = t(s.incident), t(s.wavelength_factor)
        if widths.get("dispersion", 0.0) > 0.0:
            factor = factor + offset_change(t(s.wavelength_offset), p["dispersion"], widths["dispersion"])
        if widths.get("divergence_h", 0.0) > 0.0 or widths.get("divergence_v", 0.0) > 0.0:
            angles = t(s.source_angles_rad)
            moved = [a + offset_change(a, p[n], widths[n]) if widths[n] > 0.0 else a
                     for a, n in zip(angles.unbind(-1), ("divergence_h", "divergence_v"))]
            beam, polar = t(self.setup.beam), t(self.setup.polar_axis)
            incident = incident + (source_directions(beam, polar, *moved)
                                   - source_directions(beam, polar, angles[:, 0], angles[:, 1]))
        return incident, p["wavelength"] * factor

    def parameter_names(self) -> tuple[str, ...]:
        """Every name :meth:`parameters_dict` holds: the canonical names and, for several panels, the per-panel
        geometry names (:meth:`nbtorch.geometry.panels.PanelLayout.names`)."""
        return SIMULATOR_NAMES + (self.panel_layout.names() if self.panel_layout is not None else ())

    def geometry(self, p: dict[str, Tensor], panel: int | None = None) -> DetectorGeometry:
        """Resolved detector geometry for parameters ``p`` (from :meth:`parameters_dict`).

        Several panels: panel ``panel``'s geometry (from its names ``distance_p<i>`` ...), or with ``panel``
        None all panels stacked on a leading axis (:func:`~nbtorch.physics.detector.stack_geometries`).
        """
        layout = self.panel_layout
        if layout is None:
            return self._detector_geometry(self.setup.detector, p, "")
        if panel is not None:
            return self._detector_geometry(layout.panels[panel].detector, p, f"_p{int(panel)}")
        kinds = {(d.detector.convention, d.detector.pivot) for d in layout.panels}
        if len(kinds) == 1:  # one batched call: each panel the bits of its own call, a fraction of the cost
            return self._panels_geometry(p)
        return stack_geometries([self._detector_geometry(d.detector, p, f"_p{i}")
                                 for i, d in enumerate(layout.panels)])

    #: a detector's fixed axes and sizes, the inputs of :func:`detector_geometry` that no parameter moves
    _AXES = ("fdet", "sdet", "odet", "beam", "twotheta_axis")
    _SIZES = ("pixel_m", "detsize_s_m")

    def _panels_geometry(self, p: dict[str, Tensor]) -> DetectorGeometry:
        """All panels' geometry in one :func:`detector_geometry` call with a leading panel axis (panels that
        share convention and pivot): (N, 3) vectors, (N,) scalars, as :func:`stack_geometries`."""
        layout = self.panel_layout
        key = (id(layout), self.dtype, self.device)
        if getattr(self, "_panel_axes", (None,))[0] != key:  # the panels' fixed axes, converted once
            d = [q.detector for q in layout.panels]
            self._panel_axes = (key, {name: self._t(np.stack([getattr(x, name) for x in d])) for name in self._AXES}
                                | {name: self._t(np.array([getattr(x, name) for x in d], dtype=np.float64))
                                   for name in self._SIZES})
        n = len(layout.panels)
        first = layout.panels[0].detector
        return self._geometry_of(first.convention, first.pivot, self._panel_axes[1],
                                 lambda name: torch.stack([p[f"{name}_p{i}"] for i in range(n)]))

    def _detector_geometry(self, d, p: dict[str, Tensor], suffix: str) -> DetectorGeometry:
        """:func:`detector_geometry` of detector set-up ``d`` with the geometry names ``<name><suffix>`` of ``p``:
        (3,) vectors, () scalars (the shapes the compiled kernels are keyed on)."""
        axes = {name: self._t(getattr(d, name)) for name in self._AXES + self._SIZES}
        return self._geometry_of(d.convention, d.pivot, axes, lambda name: p[name + suffix])

    @staticmethod
    def _geometry_of(convention, pivot, axes: dict[str, Tensor], value) -> DetectorGeometry:
        """:func:`detector_geometry` from a detector's fixed ``axes`` (:attr:`_AXES`, :attr:`_SIZES`; one panel's or
        stacked with a leading panel axis) and ``value(name)``, the geometry parameter ``name`` (mm, deg)."""
        deg = math.pi / 180.0
        fb, sb, fc, sc = detector_offsets_m(convention, value("beam_x") / 1000.0, value("beam_y") / 1000.0,
                                            axes["pixel_m"], axes["detsize_s_m"])
        return detector_geometry(
            axes["fdet"], axes["sdet"], axes["odet"], axes["beam"], axes["twotheta_axis"], pivot,
            value("distance") / 1000.0, fb, sb, fc, sc,
            value("detector_rotx") * deg, value("detector_roty") * deg, value("detector_rotz") * deg,
            value("twotheta") * deg,
        )

    def crystal_vectors(self, p: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """``(real (3, 3), recip (3, 3))``: the crystal's real-space (Å, rows a, b, c) and reciprocal (1/Å)
        vectors in the lab frame at phi 0 without mosaic: the cell, ``-mat``/``-misset`` and the small
        orientation deltas ``orient_x/y/z`` of ``p`` (canonical parameters, degrees)."""
        s = self.setup
        deg = math.pi / 180.0
        cell = torch.stack([p["cell_a"], p["cell_b"], p["cell_c"],
                            p["cell_alpha"] * deg, p["cell_beta"] * deg, p["cell_gamma"] * deg])
        misset = rotation_matrix_xyz(p["misset_x"] * deg, p["misset_y"] * deg, p["misset_z"] * deg)
        delta = rotation_matrix_xyz(p["orient_x"] * deg, p["orient_y"] * deg, p["orient_z"] * deg)
        orientation = delta @ misset @ self._t(s.orientation0)
        return crystal_real_and_reciprocal(cell, orientation, s.cell_quirk)

    def crystal(self, p: dict[str, Tensor], first_evaluation: bool = False) -> tuple[Tensor, Tensor]:
        """``(real_A (Φ, M, 3, 3), recip (3, 3))``: crystal vectors per phi step and mosaic domain."""
        s = self.setup
        t = self._t
        deg = math.pi / 180.0
        real, recip = self.crystal_vectors(p)
        phi = phi_angles(p["phi0"] * deg, s.phistep_deg * deg, s.phisteps, s.phi_quirk, first_evaluation)
        r_phi = rotation_matrix_axis_angle(t(s.spindle).expand(len(phi), 3), phi)  # (Φ, 3, 3)
        if s.mosaic_anisotropic:  # one spread per crystal axis (nbtorch.physics.mosaic): U_m depends on phi
            spreads = torch.stack([p[n] for n in MOSAIC_AXIS_NAMES]) * deg
            u_mos = anisotropic_mosaic_rotations(t(s.mosaic_axes), t(s.mosaic_fractions), spreads,
                                                 crystal_frame(real), r_phi)  # (Φ, M, 3, 3)
        else:
            u_mos = isotropic_mosaic_rotations(t(s.mosaic_axes), t(s.mosaic_fractions),
                                               p["mosaic_spread"] * deg)[None]  # (1, M, 3, 3)
        total = u_mos @ r_phi[:, None]  # (Φ, M, 3, 3): U_m R_phi
        real_A = real @ total.transpose(-1, -2)
        return real_A, recip

    def kernel_inputs(self, p: dict[str, Tensor], geom: DetectorGeometry, F_grid: Tensor | None) -> KernelInputs:
        s = self.setup
        t = self._t
        real_A, recip = self.crystal(p)
        incident, wavelength_A = self.sources(p)
        return KernelInputs(
            incident=incident,
            wavelength_A=wavelength_A,
            real_A=real_A,
            recip_per_A=recip,
            n_cells=size_vector([p[n] for n in SIZE_DIAGONAL], [p[n] for n in SIZE_OFF_DIAGONAL], s.shape),
            fudge=t(s.fudge),
            F_grid=F_grid,
            hkl_min=None if s.hkl_min is None else t(s.hkl_min),
            hkl_max=None if s.hkl_max is None else t(s.hkl_max),
            default_F=p["default_F"],
            polar_axis=t(s.polar_axis),
            kahn=p["polarization"],
            odet=geom.odet,
            close_distance_m=geom.close_distance,
            pixel_m=t(s.pixel_m),
            mu_per_m=t(s.mu_per_m),
            layer_thickness_m=t(s.layer_thickness_m),
            dmin_A=t(s.dmin_A),
            fluence=p["fluence"],
            steps=t(float(s.steps)),
            water_F2N=t(s.water_F2N),
        )


    def forward(self, **overrides) -> Tensor:
        """Full detector image (slow, fast) in photons per pixel; zero outside the ROI."""
        roi_image, _ = self.render(**overrides)
        x0, x1, y0, y1 = self.setup.roi
        if roi_image.shape == self.shape:
            return roi_image
        full = roi_image.new_zeros(self.shape)
        full[y0:y1 + 1, x0:x1 + 1] = roi_image
        return full


def kernel_options(config: SimulationConfig, s: Setup) -> KernelOptions:
    """The kernel's static options of a config and its resolved set-up."""
    return KernelOptions(
        shape=s.shape,
        interpolate=s.interpolate,
        nopolar=config.nopolar,
        point_pixel=config.point_pixel,
        curved=config.curved_det,
        c_parity=s.c_parity,
        oversample_thick=config.oversample_thick,
        oversample_polar=config.oversample_polar,
        oversample_omega=config.oversample_omega,
        has_thickness=s.has_thickness,
        has_water=s.water_F2N > 0,
        use_dmin=s.dmin_A > 0,
    )
