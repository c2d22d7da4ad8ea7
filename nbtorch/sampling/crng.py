"""C-parity random numbers: nanoBragg's Numerical Recipes generators, state made explicit.

nanoBragg draws every random number through the Numerical Recipes routines
``ran1`` (Park-Miller minimal standard LCG with a 32-entry Bays-Durham shuffle),
``gaussdev`` (polar Box-Muller), ``poidev`` (direct method below 12, rejection
with a Lorentzian comparison function above, a Gaussian above 1e6) and
``gammln``.  In C these keep *static* state that belongs to the process, not to a
seed: ``ran1``'s ``iy``/``iv[32]`` shuffle table is shared by ``misset_seed``,
``mosaic_seed`` and the noise ``seed``.  Here that per-process state is a
:class:`CRandomState` object and each C ``long`` seed variable is a
:class:`CRandom` holding its current value and a reference to a state, so several
seeds can share one table exactly as in a single C run.

Arithmetic follows the C types: where the C stores into a ``float`` the value is
rounded to IEEE single precision (double arithmetic followed by one rounding is
exact for + - * / sqrt), ``double`` work uses Python floats and the ``math``
module (the platform libm, as in the C), and ``powf`` is the libm ``powf``.

Seeds.  ``ran1`` re-seeds its table whenever the value passed in is <= 0 (or the
table is still empty; then a positive value is replaced by 1).  The program
stores ``-seed N``, ``-mosaic_seed N`` and ``-misset_seed N`` as ``-N``, so for
N > 0 every sequence depends on N alone.  The high-level helpers below therefore
take the *command-line value* N, or a :class:`CRandom` (holding the C value
itself) when a shared state must be reproduced, e.g. for N <= 0.  Defaults in the
C: mosaic seed -12345678 (flag value 12345678); the noise seed is -time(), and
``misset_seed`` is initialised from it *before* the flags are read, so ``-seed``
does not change it.  This module is for C-parity mode only; it is not
differentiable and not fast.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from nbtorch.errors import InputError

__all__ = [
    "CRandomState", "CRandom", "gammln", "mosaic_rotation_umat", "umat_from_axis_angle",
    "c_mosaic_angle", "mosaic_axis_angle_draws", "mosaic_domain_draws", "mosaic_umats_c",
    "resolve_mosaic_domains", "umat2misset", "RandomMisset", "random_misset_umat",
    "poisson_noise_image", "MOSAIC_SEED_DEFAULT", "RTD",
]

# ran1 constants (Park-Miller with Schrage's factorisation)
_IA, _IM, _IQ, _IR, _NTAB = 16807, 2147483647, 127773, 2836, 32
_NDIV = 1 + (_IM - 1) // _NTAB
_AM = 1.0 / _IM
_RNMX = 1.0 - 1.2e-7
_GAMMLN_COF = (76.18009172947146, -86.50532032941677, 24.01409824083091,
               -1.231739572450155, 0.1208650973866179e-2, -0.5395239384953e-5)

MOSAIC_SEED_DEFAULT = 12345678  # flag value; the C variable starts at -12345678
RTD = 180.0 * 0.31830988618379067154  # the C's 180*M_1_PI

_F = struct.Struct("f")
_pack, _unpack = _F.pack, _F.unpack


def _f32(x: float) -> float:
    """Round a double to the nearest float32 (as a C assignment to ``float``)."""
    try:
        return _unpack(_pack(x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _exp(x: float) -> float:
    return math.exp(x) if x < 709.0 else (math.inf if x == x else x)


def _load_powf():
    """libm's ``powf`` (what the C links); numpy's float32 power as a fallback."""
    fn = None
    for name in ("libm.so.6", None):
        name = name or ctypes.util.find_library("m")  # only searched if needed
        try:
            fn = ctypes.CDLL(name).powf if name else None
        except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
            continue
        if fn is not None:
            break
    if fn is None:  # pragma: no cover
        return lambda x, y: float(np.power(np.float32(x), np.float32(y)))
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    return fn


_powf = _load_powf()
_ONE_THIRD_F = _f32(1.0 / 3.0)


def gammln(xx: float) -> float:
    """ln Gamma(xx) as the C's ``float gammln(float)`` (Lanczos, double inside)."""
    x = y = _f32(xx)
    tmp = x + 5.5
    tmp -= (x + 0.5) * math.log(tmp)
    ser = 1.000000000190015
    for c in _GAMMLN_COF:
        y += 1.0
        ser += c / y
    return _f32(-tmp + math.log(2.5066282746310005 * ser / x))


@dataclass
class CRandomState:
    """The process-wide statics of the C routines (one per simulated C run)."""

    iy: int = 0                                    # ran1: last shuffled output (0 = empty)
    iv: list[int] = field(default_factory=lambda: [0] * _NTAB)  # ran1 shuffle table
    poi_oldm: float = -1.0                         # poidev: last xm and its cached terms
    poi_g: float = 0.0
    poi_sq: float = 0.0
    poi_alxm: float = 0.0
    gauss_iset: int = 0                            # gaussdev: spare deviate flag / value
    gauss_gset: float = 0.0


class CRandom:
    """One C ``long`` seed variable (``idum``) bound to a :class:`CRandomState`.

    ``CRandom(-12345678)`` is the C's ``long mosaic_seed = -12345678``.  Pass the
    same ``state`` to several instances to share the static shuffle table.
    """

    def __init__(self, seed: int, state: CRandomState | None = None) -> None:
        self.idum = int(seed)
        self.state = state if state is not None else CRandomState()

    def ran1(self) -> float:
        """Uniform deviate in (0, 1): the float32 value the C returns."""
        st = self.state
        idum = self.idum
        iv = st.iv
        if idum <= 0 or not st.iy:
            idum = 1 if -idum < 1 else -idum
            for j in range(_NTAB + 7, -1, -1):
                k = idum // _IQ
                idum = _IA * (idum - k * _IQ) - _IR * k
                if idum < 0:
                    idum += _IM
                if j < _NTAB:
                    iv[j] = idum
            st.iy = iv[0]
        k = idum // _IQ
        idum = _IA * (idum - k * _IQ) - _IR * k
        if idum < 0:
            idum += _IM
        self.idum = idum
        j = st.iy // _NDIV
        st.iy = iv[j]
        iv[j] = idum
        temp = _unpack(_pack(_AM * st.iy))[0]
        return 0.9999998807907104 if temp > _RNMX else temp  # (float)RNMX

    def gaussdev(self) -> float:
        """Unit normal deviate (float), keeping the C's spare-deviate static."""
        st = self.state
        if st.gauss_iset:
            st.gauss_iset = 0
            return st.gauss_gset
        while True:
            v1 = _f32(2.0 * self.ran1() - 1.0)
            v2 = _f32(2.0 * self.ran1() - 1.0)
            rsq = _f32(_f32(v1 * v1) + _f32(v2 * v2))
            if not (rsq >= 1.0 or rsq == 0.0):
                break
        fac = _f32(math.sqrt(-2.0 * math.log(rsq) / rsq))
        st.gauss_gset = _f32(v1 * fac)
        st.gauss_iset = 1
        return _f32(v2 * fac)

    def poidev(self, xm: float) -> float:
        """Poisson deviate with mean ``xm`` (a C float), as the C's ``poidev``."""
        st = self.state
        xm = _f32(xm)
        if xm > 1.0e6:
            return _f32(xm + math.sqrt(xm) * self.gaussdev())
        if xm < 12.0:
            if xm != st.poi_oldm:
                st.poi_oldm = xm
                st.poi_g = _f32(_exp(-xm))
            g = st.poi_g
            em, t = -1.0, 1.0
            while True:
                em += 1.0
                t = _unpack(_pack(t * self.ran1()))[0]
                if not t > g:
                    return em
        if xm != st.poi_oldm:
            st.poi_oldm = xm
            st.poi_sq = _f32(math.sqrt(2.0 * xm))
            st.poi_alxm = _f32(math.log(xm)) if xm > 0.0 else math.nan
            st.poi_g = _f32(_f32(xm * st.poi_alxm) - gammln(_f32(xm + 1.0)))
        sq, alxm, g = st.poi_sq, st.poi_alxm, st.poi_g
        while True:
            while True:
                y = _f32(math.tan(math.pi * self.ran1()))
                em = _f32(_f32(sq * y) + xm)
                if not em < 0.0:
                    break
            if math.isfinite(em):
                em = float(math.floor(em))
            arg = _f32(_f32(_f32(em * alxm) - gammln(_f32(em + 1.0))) - g)
            t = _f32(0.9 * (1.0 + _f32(y * y)) * _exp(arg))
            if not self.ran1() > t:
                return em


def _as_rng(seed: int | CRandom) -> CRandom:
    """A flag value N becomes a fresh C variable holding -N; a CRandom is used as is."""
    return seed if isinstance(seed, CRandom) else CRandom(-int(seed))


def _axis_fraction(rng: CRandom) -> tuple[tuple[float, float, float], float]:
    """The three draws of one ``mosaic_rotation_umat`` call: (axis, powf fraction)."""
    r1 = 2.0 * rng.ran1() - 1.0
    r2 = 2.0 * rng.ran1() - 1.0
    r3 = 2.0 * rng.ran1() - 1.0
    xyrad = math.sqrt(1.0 - r2 * r2)
    frac = float(_powf(_f32(1.0 - r3 * r3), _ONE_THIRD_F))
    return (xyrad * math.sin(math.pi * r1), xyrad * math.cos(math.pi * r1), r2), frac


def c_mosaic_angle(spread_rad: float, fraction: float) -> float:
    """The C's rotation angle: ``(float)spread * fraction`` rounded to float.

    ``spread_rad * fraction`` in double differs from it by <= ~1.2e-7 relative;
    use this (or a float32 product) where bit parity with the C matters.
    """
    return _f32(_f32(spread_rad) * _f32(fraction))


def umat_from_axis_angle(axis, angle: float) -> np.ndarray:
    """Rotation by ``angle`` (rad) about ``axis``, evaluated in the C's exact order."""
    # not nbtorch.physics.rotation: this copy keeps the C's operation order (bit parity of the
    # C's mosaic matrices, tests/test_crng.py); the simulator itself uses the torch rotation
    v1, v2, v3 = (float(a) for a in axis)
    c, s = math.cos(angle), math.sin(angle)
    omc = 1.0 - c
    w1 = omc * v1
    w2 = omc * v2
    return np.array([
        [c + omc * (v1 * v1), w1 * v2 - s * v3, w1 * v3 + s * v2],
        [w1 * v2 + s * v3, c + omc * (v2 * v2), w2 * v3 - s * v1],
        [w1 * v3 - s * v2, w2 * v3 + s * v1, c + omc * (v3 * v3)],
    ], dtype=np.float64)


def mosaic_rotation_umat(spread_rad: float, rng: CRandom) -> np.ndarray:
    """The C's ``mosaic_rotation_umat(float mosaicity, umat, &seed)``: 3 draws.

    ``spread_rad`` is rounded to float as the C's parameter; the angle is
    ``spread * (1-r3^2)^(1/3)`` about an isotropic random axis.
    """
    axis, frac = _axis_fraction(rng)
    return umat_from_axis_angle(axis, c_mosaic_angle(spread_rad, frac))


def mosaic_axis_angle_draws(n_domains: int, seed: int | CRandom = MOSAIC_SEED_DEFAULT
                            ) -> tuple[np.ndarray, np.ndarray]:
    """Raw draws of ``n_domains`` consecutive umat calls: axes (n,3), fractions (n,).

    Call m's umat is ``umat_from_axis_angle(axes[m], c_mosaic_angle(spread, fractions[m]))``
    bit for bit.  Axes are as the C computes them (unit to ~1e-16, not renormalised).
    """
    rng = _as_rng(seed)
    axes = np.empty((n_domains, 3), dtype=np.float64)
    fracs = np.empty(n_domains, dtype=np.float64)
    for m in range(n_domains):
        axes[m], fracs[m] = _axis_fraction(rng)
    return axes, fracs


def mosaic_domain_draws(n_domains: int, seed: int | CRandom = MOSAIC_SEED_DEFAULT
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Per-domain (axes, fractions) of nanoBragg's mosaic list: domain 0 has fraction 0.

    The C's domain 0 still consumes three draws but is overwritten by the identity.
    """
    axes, fracs = mosaic_axis_angle_draws(n_domains, seed)
    if n_domains:
        fracs[0] = 0.0
    return axes, fracs


def mosaic_umats_c(spread_deg: float, n_domains: int,
                   seed: int | CRandom = MOSAIC_SEED_DEFAULT) -> np.ndarray:
    """The C's ``mosaic_umats`` array as (n,3,3): domain 0 identity, the rest random.

    ``spread_deg`` and ``seed`` are the ``-mosaic`` and ``-mosaic_seed`` values; pass
    counts already resolved by :func:`resolve_mosaic_domains` (the C always runs this
    loop, also for spread 0, where all umats are the identity and are not used).
    """
    if n_domains < 0:
        raise InputError(f"mosaic domains: expected a count >= 0, got {n_domains}")
    rng = _as_rng(seed)
    spread_rad = spread_deg / RTD
    out = np.empty((n_domains, 3, 3), dtype=np.float64)
    for m in range(n_domains):
        out[m] = mosaic_rotation_umat(spread_rad, rng)
    if n_domains:
        out[0] = np.eye(3)
    return out


def resolve_mosaic_domains(spread_deg: float | None, n_domains: int | None
                           ) -> tuple[float, int]:
    """The C's auto rules: (spread in degrees, domain count) actually simulated.

    No spread -> (0, 1); spread 0 -> 1 domain; spread > 0 without a count (or a
    count <= 0) -> 10 domains.  The C's spread is ``atof/RTD`` radians.
    """
    if spread_deg is None or spread_deg / RTD < 0.0:
        return 0.0, 1
    if spread_deg / RTD == 0.0:
        return 0.0, 1
    if n_domains is None or n_domains <= 0:
        return float(spread_deg), 10
    return float(spread_deg), int(n_domains)


def umat2misset(umat) -> tuple[float, float, float]:
    """The C's ``umat2misset``: (rotx, roty, rotz) in radians from a 3x3 matrix."""
    u = [[float(v) for v in row] for row in np.asarray(umat, dtype=np.float64).reshape(3, 3)]

    def norms() -> list[float]:
        ms = [math.sqrt(r[0] * r[0] + r[1] * r[1] + r[2] * r[2]) for r in u]
        for r, m in zip(u, ms):
            if m > 0:
                r[0] /= m; r[1] /= m; r[2] /= m  # noqa: E702
        return ms

    def cross(a: list[float], b: list[float]) -> list[float]:
        c = [a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0]]
        m = math.sqrt(c[0] * c[0] + c[1] * c[1] + c[2] * c[2])
        return [c[0] / m, c[1] / m, c[2] / m] if m > 0 else c

    mx, my, mz = norms()
    eye = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    for keep, others in ((mx >= 0 and my <= 0 and mz <= 0, (1, 2)),
                         (mx <= 0 and my >= 0 and mz <= 0, (0, 2)),
                         (mx <= 0 and my <= 0 and mz >= 0, (0, 1))):
        if keep:
            for i in others:
                u[i] = list(eye[i])
    for _ in range(2):  # the C substitutes empty rows by cross products, twice
        xcy, ycz, zcx = cross(u[0], u[1]), cross(u[1], u[2]), cross(u[2], u[0])
        if mx <= 0:
            u[0] = ycz
        if my <= 0:
            u[1] = zcx
        if mz <= 0:
            u[2] = xcy
    norms()
    (uxx, uxy, _), (uyx, uyy, _), (uzx, uzy, uzz) = u
    if uzx * uzx < 1.0:
        return (math.atan2(uzy, uzz), math.atan2(-uzx, math.sqrt(uzy * uzy + uzz * uzz)),
                math.atan2(uyx, uxx))
    return math.atan2(1, 1) * 4, math.atan2(1, 1) * 2, math.atan2(uxy, -uyy)


class RandomMisset(NamedTuple):
    umat: np.ndarray        # (3,3) random orientation drawn by the C
    misset_rad: np.ndarray  # (3,) rotx, roty, rotz the C then applies (radians)
    misset_deg: np.ndarray  # (3,) misset_rad * RTD, as printed ("%f")


def random_misset_umat(seed: int | CRandom) -> RandomMisset:
    """``-misset random``: ``mosaic_rotation_umat(90.0, ...)`` (90 *radians*) on
    ``misset_seed``, then ``umat2misset``; the C applies only the angles via
    ``rotate(x, y, z)``, never the umat itself.  ``seed`` is the ``-misset_seed``
    value (the C default is the time-based noise seed).
    """
    umat = mosaic_rotation_umat(90.0, _as_rng(seed))
    rad = np.array(umat2misset(umat), dtype=np.float64)
    return RandomMisset(umat, rad, rad * RTD)


def poisson_noise_image(float_image: np.ndarray, seed: int | CRandom, adc: float = 40.0,
                        roi_mask: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """The C's ``-noisefile`` pixels: ``(uint16)(poidev(float) + adc)``, clipped at 65535.

    Pixels are visited slow-major; those outside ``roi_mask`` (True = inside) draw
    nothing and are 0.  ``seed`` is the ``-seed`` value N (the C uses -N); for
    N <= 0 the C keeps the table left by the mosaic draws, so pass a CRandom sharing
    that state.  Returns the image and ``{"photons": sum of deviates (printed "%.0f"),
    "overloads": count, "seed": the C seed variable afterwards}``.
    """
    img = np.asarray(float_image, dtype=np.float32)
    if img.ndim != 2:
        raise InputError(f"float image: expected a 2-D (slow, fast) array, got shape {img.shape}")
    if roi_mask is not None and np.shape(roi_mask) != img.shape:
        raise InputError(f"roi mask: shape {np.shape(roi_mask)} does not match image {img.shape}")
    rng = _as_rng(seed)
    poidev = rng.poidev
    values = img.ravel().tolist()
    inside = None if roi_mask is None else np.asarray(roi_mask, dtype=bool).ravel().tolist()
    out = [0] * len(values)
    total, overloads, adc = 0.0, 0, float(adc)
    for i, xm in enumerate(values):
        if inside is not None and not inside[i]:
            continue
        test = poidev(xm)
        total += test
        test += adc
        if test > 65535.0:
            test = 65535.0
            overloads += 1
        # (unsigned short) of a double: truncate toward zero, keep the low 16 bits
        out[i] = (int(test) & 0xFFFF) if math.isfinite(test) else 0
    image = np.array(out, dtype=np.uint16).reshape(img.shape)
    return image, {"photons": total, "overloads": overloads, "seed": rng.idum}
