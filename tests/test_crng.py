"""Tests for nbtorch.sampling.crng, the C-parity Numerical Recipes random numbers.

Hard-coded expectations marked "C:" were printed by the reference nanoBragg.c
(bl831 455534a) compiled with GCC 12.2 -O2 on glibc 2.36 (the goldens' toolchain),
calling its own ran1/poidev/gammln/mosaic_rotation_umat/umat2misset from a tiny
driver; floats were printed with "%a" (exact) or "%.9g" (exact for float32).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from nbtorch.sampling.crng import (
    RTD, CRandom, CRandomState, c_mosaic_angle, gammln, mosaic_axis_angle_draws,
    mosaic_domain_draws, mosaic_rotation_umat, mosaic_umats_c, poisson_noise_image,
    random_misset_umat, resolve_mosaic_domains, umat2misset, umat_from_axis_angle,
)

from golden import GOLDEN, MISSING


def _golden(case: str) -> Path:
    path = GOLDEN / case
    if not path.is_dir():
        pytest.skip(MISSING if not GOLDEN.is_dir() else f"golden case {case} not found under {GOLDEN}")
    return path


def _hexmat(text: str) -> np.ndarray:
    return np.array([float.fromhex(v) for v in text.split()]).reshape(3, 3)


# ---------------------------------------------------------------- ran1
def _slow_ran1_stream(seed: int, n: int) -> list[tuple[float, int]]:
    """Textbook NR ran1, written independently with numpy scalar types."""
    im, ntab = 2147483647, 32
    idum = np.int64(seed)
    iv = [np.int64(0)] * ntab
    iy = np.int64(0)
    out = []
    for _ in range(n):
        if idum <= 0 or iy == 0:
            idum = np.int64(max(1, -int(idum)))
            for j in range(ntab + 7, -1, -1):
                idum = np.int64((16807 * int(idum)) % im)  # Schrage == exact modulus
                if j < ntab:
                    iv[j] = idum
            iy = iv[0]
        idum = np.int64((16807 * int(idum)) % im)
        j = int(iy) // (1 + (im - 1) // ntab)
        iy = iv[j]
        iv[j] = idum
        temp = np.float32(np.float64(1.0 / im) * np.float64(iy))
        out.append((float(min(temp, np.float32(1.0 - 1.2e-7))), int(idum)))
    return out


@pytest.mark.parametrize("seed", [-12345678, -12345, -777, -1, 0])
def test_ran1_matches_slow_reference(seed: int) -> None:
    rng = CRandom(seed)
    for value, idum in _slow_ran1_stream(seed, 3000):
        assert rng.ran1() == value
        assert rng.idum == idum


def test_ran1_first_values_from_c() -> None:
    # C: ran1(&seed) with seed = -12345678 (nanoBragg's default mosaic_seed)
    expected = [(0.765989304, 1149121912), (0.023453664, 971537513),
                (0.589726627, 1312812850), (0.535101593, 1198580672),
                (0.982231438, 1148745444)]
    rng = CRandom(-12345678)
    for value, idum in expected:
        assert rng.ran1() == float(np.float32(value))
        assert rng.idum == idum


def test_ran1_seed_rules_and_shared_table() -> None:
    # a positive seed on an empty table is replaced by 1, like 0 and -1
    assert CRandom(5).ran1() == CRandom(-1).ran1()
    assert CRandom(0).ran1() == CRandom(-1).ran1() == float(np.float32(0.415999353))  # C
    # a positive seed on a filled table does not re-seed: it uses the shared statics
    state = CRandomState()
    first = CRandom(-12345678, state)
    first.ran1()
    table = list(state.iv), state.iy
    other = CRandom(5, state)
    other.ran1()
    assert other.idum == 5 * 16807 and (list(state.iv), state.iy) != table
    # a negative seed re-seeds the shared table: the sequence depends on it alone
    fresh, shared = CRandom(-42), CRandom(-42, state)
    assert [fresh.ran1() for _ in range(50)] == [shared.ran1() for _ in range(50)]


# ---------------------------------------------------------------- gammln / poidev
def test_gammln_from_c_and_accuracy() -> None:
    # C: gammln(1.5), gammln(13), gammln(100.25)
    assert gammln(1.5) == float.fromhex("-0x1.eeb95cp-4")
    assert gammln(13.0) == float.fromhex("0x1.3fcba2p+4")
    assert gammln(100.25) == float.fromhex("0x1.6848d8p+8")
    for x in (0.5, 2.0, 7.25, 55.0, 1e4):
        assert gammln(x) == pytest.approx(math.lgamma(x), rel=1e-6, abs=1e-6)


def test_poidev_sequence_from_c() -> None:
    # C: one seed variable (-777), six poidev draws each for xm = 3, 15.5, 200, 2e6
    expected = {3.0: [7, 6, 2, 3, 3, 0], 15.5: [11, 18, 13, 18, 11, 13],
                200.0: [226, 187, 192, 200, 210, 190],
                2e6: [1998139.75, 2002469.12, 1997757.62, 1999243.12, 1998486.88, 1999653.62]}
    rng = CRandom(-777)
    for xm, values in expected.items():
        got = [rng.poidev(xm) for _ in values]
        assert got == [float(np.float32(v)) for v in values]


def test_poidev_mean() -> None:
    rng = CRandom(-99)
    for xm in (0.7, 5.0, 30.0):
        draws = np.array([rng.poidev(xm) for _ in range(4000)])
        assert abs(draws.mean() - xm) < 5 * math.sqrt(xm / draws.size)
        assert np.all(draws == np.floor(draws))


# ---------------------------------------------------------------- noise image
@pytest.mark.parametrize("case", ["water_noise", "fluence", "flux"])
def test_noise_image_matches_golden(case: str) -> None:
    path = _golden(case)
    args = (path / "args.txt").read_text().split()
    seed = int(args[args.index("-seed") + 1])
    adc = float(args[args.index("-adc") + 1]) if "-adc" in args else 40.0
    raw = (path / "noise.img").read_bytes()
    header = raw[:512].decode("ascii", "replace")
    fast = int(re.search(r"SIZE1=(\d+);", header).group(1))
    slow = int(re.search(r"SIZE2=(\d+);", header).group(1))
    floats = np.fromfile(path / "float.bin", "<f4").reshape(slow, fast)
    expected = np.frombuffer(raw[512:], "<u2").reshape(slow, fast)
    image, stats = poisson_noise_image(floats, seed, adc=adc)
    assert image.dtype == np.uint16 and image.shape == (slow, fast)
    assert np.array_equal(image, expected)
    printed = re.search(r"(\d+) photons on noise image \((\d+) overloads\)",
                        (path / "stdout.txt").read_text())
    assert f"{stats['photons']:.0f}" == printed.group(1)
    assert stats["overloads"] == int(printed.group(2))


def test_noise_roi_overloads_and_seed_convention() -> None:
    floats = np.full((6, 7), 3.0, dtype=np.float32)
    floats[1, 1] = 70000.0
    mask = np.zeros(floats.shape, dtype=bool)
    mask[1:4, 1:5] = True
    image, stats = poisson_noise_image(floats, 123, adc=40.0, roi_mask=mask)
    assert np.all(image[~mask] == 0)
    assert image[1, 1] == 65535 and stats["overloads"] == 1
    # the ROI pixels draw the same deviates as a plain poidev stream seeded with -123
    rng = CRandom(-123)
    draws = [rng.poidev(float(x)) for x in floats[mask]]
    assert stats["photons"] == sum(draws)
    assert np.array_equal(image[mask][1:], np.minimum(np.array(draws[1:]) + 40, 65535))
    assert stats["seed"] == rng.idum
    with pytest.raises(ValueError):
        poisson_noise_image(floats, 1, roi_mask=mask[:2])


# ---------------------------------------------------------------- mosaic
MOSAIC_C_SEED_12345_HALF_DEG = {  # C: mosaic_rotation_umat(0.5/RTD, u, &seed), seed=-12345
    1: "0x1.ffff424103354p-1 -0x1.0311a2b89a028p-9 -0x1.64a07955dd3eep-9 "
       "0x1.02bfdf3775ac8p-9 0x1.ffffb116d5cc6p-1 -0x1.d6ccac3c4481p-11 "
       "0x1.64dbd08f25858p-9 0x1.d3fb13b8283b2p-11 0x1.ffff7644ef45ap-1",
    9: "0x1.fffca6f5d037bp-1 0x1.b40fa6548ab7cp-8 0x1.560d9561514aap-9 "
       "-0x1.b4c3ed8a26494p-8 0x1.fffbf88c2069p-1 0x1.0eb5bbfdf6456p-8 "
       "-0x1.5270a82a21f9ap-9 -0x1.0fd7c14f75246p-8 0x1.fffe6f7976d1ap-1",
}


def test_mosaic_umats_match_c() -> None:
    # the golden "mosaic" case: -mosaic 0.5 -mosaic_dom 10 -mosaic_seed 12345
    # (its stdout prints no umats, so the C values come from the driver)
    args = (_golden("mosaic") / "args.txt").read_text().split()
    spread = float(args[args.index("-mosaic") + 1])
    n = int(args[args.index("-mosaic_dom") + 1])
    seed = int(args[args.index("-mosaic_seed") + 1])
    umats = mosaic_umats_c(spread, n, seed)
    assert umats.shape == (10, 3, 3)
    assert np.array_equal(umats[0], np.eye(3))
    for m, text in MOSAIC_C_SEED_12345_HALF_DEG.items():
        assert np.array_equal(umats[m], _hexmat(text))


def test_mosaic_split_form_and_properties() -> None:
    spread_deg, n = 0.5, 10
    spread = spread_deg / RTD
    umats = mosaic_umats_c(spread_deg, n, 12345)
    axes, fracs = mosaic_domain_draws(n, 12345)
    raw_axes, raw_fracs = mosaic_axis_angle_draws(n, 12345)
    assert fracs[0] == 0.0 and np.array_equal(fracs[1:], raw_fracs[1:])
    assert np.array_equal(axes, raw_axes)
    assert np.all((fracs >= 0.0) & (fracs <= 1.0))
    np.testing.assert_allclose(np.linalg.norm(axes, axis=1), 1.0, rtol=0, atol=1e-15)
    rng = CRandom(-12345)
    for m in range(n):
        u = umats[m]
        np.testing.assert_allclose(u @ u.T, np.eye(3), atol=1e-15)
        assert np.linalg.det(u) == pytest.approx(1.0, abs=1e-14)
        exact = umat_from_axis_angle(axes[m], c_mosaic_angle(spread, fracs[m]))
        assert np.array_equal(u, exact)  # bit for bit, domain 0 included
        np.testing.assert_allclose(umat_from_axis_angle(axes[m], spread * fracs[m]), u,
                                   rtol=0, atol=1e-9)
        angle = math.acos(max(-1.0, min(1.0, (np.trace(u) - 1.0) / 2.0)))
        assert angle == pytest.approx(spread * fracs[m], rel=1e-5, abs=1e-7)
        if m:  # the rotation axis is the eigenvector with eigenvalue 1
            np.testing.assert_allclose(u @ axes[m], axes[m], atol=1e-15)
            assert np.array_equal(mosaic_rotation_umat(spread, rng), u)
        else:
            mosaic_rotation_umat(spread, rng)  # domain 0 consumes its three draws too
    # spread 0: all identity; explicit CRandom gives the C variable itself
    assert np.array_equal(mosaic_umats_c(0.0, 3, CRandom(-12345678)), np.tile(np.eye(3), (3, 1, 1)))


def test_resolve_mosaic_domains() -> None:
    assert resolve_mosaic_domains(None, None) == (0.0, 1)
    assert resolve_mosaic_domains(None, 7) == (0.0, 1)
    assert resolve_mosaic_domains(0.0, 7) == (0.0, 1)
    assert resolve_mosaic_domains(0.5, None) == (0.5, 10)
    assert resolve_mosaic_domains(0.5, 3) == (0.5, 3)


# ---------------------------------------------------------------- random misset
def _rotate_xyz(rx: float, ry: float, rz: float) -> np.ndarray:
    cx, sx, cy, sy, cz, sz = (math.cos(rx), math.sin(rx), math.cos(ry), math.sin(ry),
                              math.cos(rz), math.sin(rz))
    mx = np.array([[1, 0, 0], [0, cx, -sx], [0, sx, cx]])
    my = np.array([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]])
    mz = np.array([[cz, -sz, 0], [sz, cz, 0], [0, 0, 1]])
    return mz @ my @ mx  # the C's rotate(): about x, then y, then z


def test_random_misset_matches_c() -> None:
    # C: mosaic_rotation_umat(90.0, umat, &misset_seed) with -misset_seed 5, umat2misset
    umat, rad, deg = random_misset_umat(5)
    expected = _hexmat("0x1.dea9ffa65e56cp-2 0x1.bbbdcf273fe0ap-1 -0x1.64d2f4daac68ap-3 "
                       "0x1.527dabdb29d98p-2 -0x1.6aa6eca37a4f7p-2 -0x1.bfe83d8ad874ep-1 "
                       "-0x1.a3c92d40fa3fcp-1 0x1.67c4d308108b5p-2 -0x1.cee25896ad5e6p-2")
    assert np.array_equal(umat, expected)
    assert list(rad) == [float.fromhex(v) for v in
                         ("0x1.3d8dc572ec65fp+1", "0x1.ec25d8e49dbdp-1", "0x1.3b2497c29fa78p-1")]
    assert " ".join(f"{d:f}" for d in deg) == "142.144470 55.074207 35.266329"  # C stdout


@pytest.mark.parametrize("seed", [1, 2, 31337, 12345678])
def test_random_misset_properties(seed: int) -> None:
    umat, rad, deg = random_misset_umat(seed)
    np.testing.assert_allclose(umat @ umat.T, np.eye(3), atol=1e-14)
    assert np.linalg.det(umat) == pytest.approx(1.0, abs=1e-14)
    np.testing.assert_allclose(_rotate_xyz(*rad), umat, atol=1e-12)
    np.testing.assert_allclose(deg, rad * RTD, rtol=0, atol=0)
    assert umat2misset(umat) == tuple(rad)
