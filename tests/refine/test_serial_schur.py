"""The arrowhead information matrix one image at a time (refine.many.schur): the Schur-complement esds equal
the dense inverse to 1e-10 relative, and the arrowhead preconditioner whitens the dense matrix exactly."""

from __future__ import annotations

import pytest
import torch

from refine.many.esds import assemble, joint_covariances
from refine.many.schur import arrowhead_factors, arrowhead_preconditioner

S, K, N = 2, 5, 7


def _blocks(seed: int):
    gen = torch.Generator().manual_seed(seed)

    def psd(q, scale):
        X = torch.randn(3 * q, q, generator=gen, dtype=torch.float64) * scale
        return X.T @ X

    # own names of very different scales (a scale of 1e3 photons beside an angle in raw units)
    scales = torch.tensor([1.0] * S + [1e-2, 1.0, 30.0, 1.0, 1e3], dtype=torch.float64)
    F = torch.stack([psd(S + K, 1.0) * scales[:, None] * scales[None, :] for _ in range(N)])
    M = torch.stack([psd(S + K, 1.0) * scales[:, None] * scales[None, :] for _ in range(N)])
    return F, M, psd(S, 0.3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_schur_esds_equal_the_dense_inverse(seed):
    F, M, R = _blocks(seed)
    Fd, Md = assemble(F, S), assemble(M, S)
    Fd[:S, :S] += R
    Md[:S, :S] += R
    C = torch.linalg.inv(Fd)
    sandwich = C @ Md @ C
    fisher_b, sandwich_b, _ = joint_covariances(F, M, S, R, blocked=True)
    for dense, blocked in ((C, fisher_b), (sandwich, sandwich_b)):
        esd_dense = torch.sqrt(torch.diagonal(dense))
        esd_blocked = torch.cat([torch.sqrt(torch.diagonal(blocked.shared)),
                                 torch.sqrt(torch.diagonal(blocked.own, dim1=1, dim2=2)).reshape(-1)])
        assert float(((esd_blocked - esd_dense) / esd_dense).abs().max()) < 1e-10
        torch.testing.assert_close(blocked.shared, dense[:S, :S], rtol=1e-10, atol=0.0)
    # a wrong elimination is caught: leaving out one image's coupling changes the shared esd far beyond 1e-10
    F_wrong = F.clone()
    F_wrong[3, :S, S:], F_wrong[3, S:, :S] = 0.0, 0.0
    wrong, _, _ = joint_covariances(F_wrong, M, S, R, blocked=True)
    assert float((wrong.shared.diagonal() / C[:S, :S].diagonal() - 1).abs().max()) > 1e-6


@pytest.mark.parametrize("held", [None, (4, 1)])
def test_arrowhead_preconditioner_whitens_the_joint_fisher_matrix(held):
    F, _, R = _blocks(5)
    parts = [arrowhead_factors(F[i], S, held[1] if held and held[0] == i else None) for i in range(N)]
    pre = arrowhead_preconditioner(torch.zeros(S + N * K, dtype=torch.float64),
                                   tuple(torch.stack([p[j] for p in parts]) for j in range(3)), R)
    Fd = assemble(F, S)
    Fd[:S, :S] += R
    if held:
        k = S + held[0] * K + held[1]
        Fd[k, :], Fd[:, k] = 0.0, 0.0
        Fd[k, k] = 1.0
    A = pre.dense()
    eye = torch.eye(S + N * K, dtype=torch.float64)
    torch.testing.assert_close(A.T @ Fd @ A, eye, rtol=0.0, atol=1e-9)
    z = torch.randn(S + N * K, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(pre.to_raw(z), A @ z, rtol=1e-12, atol=1e-12)
