"""Joint esds from blocks (refine.many.esds): the blocked Schur-complement path equals the dense inverse.

Above MAX_DENSE raw parameters a joint run's esds come from the per-image blocks without the dense
(S + nK)^2 matrix; here both paths are run on the same random arrowhead matrices (with a restraint, a held
position and a parameter without information) and must agree.
"""

from __future__ import annotations

import math

import pytest
import torch

from refine.many.esds import assemble, dense_covariances, joint_covariances

S, K, N = 3, 4, 5


def _psd(q: int, gen: torch.Generator, rank: int | None = None) -> torch.Tensor:
    X = torch.randn(rank or 3 * q, q, generator=gen, dtype=torch.float64)
    return X.T @ X


def _blocks(seed: int = 0, blind: tuple[int, int] | None = None):
    gen = torch.Generator().manual_seed(seed)
    F = torch.stack([_psd(S + K, gen) for _ in range(N)])
    M = torch.stack([_psd(S + K, gen) * 1.7 for _ in range(N)])
    if blind is not None:  # image i's own name k: the data say nothing about it
        i, k = blind
        F[i, S + k, :], F[i, :, S + k] = 0.0, 0.0
        M[i, S + k, :], M[i, :, S + k] = 0.0, 0.0
    return F, M, _psd(S, gen) * 0.3


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    finite = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), finite)
    scale = float(b[finite].abs().max())
    assert float((a[finite] - b[finite]).abs().max()) <= 1e-9 * scale


@pytest.mark.parametrize("held", [(), (S + 2,)])
def test_blocked_covariances_equal_the_dense_ones(held):
    F, M, R = _blocks()
    dense = joint_covariances(F, M, S, R, held, blocked=False)
    blocked = joint_covariances(F, M, S, R, held, blocked=True)
    for d, b in zip(dense[:2], blocked[:2]):
        _close(b.shared, d.shared)
        _close(b.own, d.own)
    for h in held:  # a held position: covariance 0 in both
        i, k = (h - S) // K, (h - S) % K
        assert float(blocked[0].own[i, k].abs().max()) == 0.0 == float(dense[0].own[i, k].abs().max())
    # the dense path itself: the inverse of the assembled matrix
    Fd, Md = assemble(F, S), assemble(M, S)
    Fd[:S, :S] += R
    Md[:S, :S] += R
    if not held:
        C = torch.linalg.inv(Fd)
        _close(dense[0].shared, C[:S, :S])
        _close(dense[1].shared, (C @ Md @ C)[:S, :S])


def test_a_parameter_without_information_has_an_infinite_esd_in_both_paths():
    F, M, R = _blocks(seed=3, blind=(2, 1))
    for blocked in (False, True):
        fisher, sandwich, cond = joint_covariances(F, M, S, R, blocked=blocked)
        for cov in (fisher, sandwich):
            assert math.isinf(float(cov.own[2, 1, 1]))
            assert torch.isfinite(cov.shared).all()
            others = torch.ones(N, K, dtype=torch.bool)
            others[2, 1] = False
            assert torch.isfinite(torch.diagonal(cov.own, dim1=1, dim2=2)[others]).all()
    dense = joint_covariances(F, M, S, R, blocked=False)
    blocked = joint_covariances(F, M, S, R, blocked=True)
    for d, b in zip(dense[:2], blocked[:2]):
        _close(b.shared, d.shared)
        _close(b.own, d.own)


def test_dense_covariances_leave_held_positions_out():
    F, M, R = _blocks(seed=5)
    Fd, Md = assemble(F, S), assemble(M, S)
    C_f, C_s, cond = dense_covariances(Fd, Md, [S + 1])
    keep = [i for i in range(Fd.shape[0]) if i != S + 1]
    Ck = torch.linalg.inv(Fd[keep][:, keep])
    _close(C_f[keep][:, keep], Ck)
    assert float(C_f[S + 1].abs().max()) == 0.0 and float(C_s[:, S + 1].abs().max()) == 0.0
    assert math.isfinite(cond) and cond > 1.0
