"""``--device`` under torchrun: each process takes the GPU of its local rank, or its entry of a list
(:func:`refine.many.distributed.process_device`, applied at the door for every mode).  On the CPU: ``LOCAL_RANK`` and
torch's CUDA queries are monkeypatched."""

from __future__ import annotations

import pytest
import torch

from nbtorch.errors import InputError
from refine.cli.parser import parse_args
from refine.many.distributed import process_device


@pytest.mark.parametrize("device, rank, count, expected", [
    ("cpu", "3", 0, "cpu"),
    ("cuda", None, 2, "cuda"),               # one process: torch's current GPU
    ("cuda", "1", 2, "cuda:1"),              # torchrun: the GPU of the local rank
    ("cuda:0", "1", 2, "cuda:0"),            # an explicit GPU stays as given
    ("cuda:0,cuda:2", "0", 3, "cuda:0"),
    ("cuda:0,cuda:2", "1", 3, "cuda:2"),
    ("cuda:0,cuda:2", "3", 3, "cuda:2"),     # local rank mod the list's length
    ("cuda:1,cuda:2", None, 3, "cuda:1"),    # a list under one process: its first
])
def test_each_process_its_device(monkeypatch, device, rank, count, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert process_device(device, local_rank=rank, count=count) == expected


@pytest.mark.parametrize("device, rank, count, available, message", [
    ("tpu", None, 1, True, "--device tpu: expected cpu, cuda, cuda:N or a list of cuda:N (cuda:0,cuda:2), got 'tpu'"),
    ("cuda:0,cpu", None, 1, True, "got 'cpu'"),
    ("cuda", "2", 2, True, "--device cuda: cuda:2 (local rank 2) is not on this machine, which has 2 GPUs "
                           "(cuda:0..cuda:1)"),
    ("cuda:0,cuda:3", "1", 2, True, "--device cuda:0,cuda:3: cuda:3 (local rank 1) is not on this machine"),
    ("cuda:4", None, 2, True, "--device cuda:4: cuda:4 is not on this machine, which has 2 GPUs"),
    ("cuda:3,cuda:0", None, 2, True, "--device cuda:3,cuda:0: cuda:3 is not on this machine"),  # one process: the first
    ("cuda", "0", 1, False, "--device cuda: CUDA is not available on this machine"),
])
def test_a_device_not_there_is_one_line(monkeypatch, device, rank, count, available, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    with pytest.raises(InputError) as exc:
        process_device(device, local_rank=rank, count=count)
    assert message in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("argv", [
    ["--problem", "cubic_mosflm"],                                                        # single
    ["--images", "a.cbf", "b.cbf", "--model", "-cell 50 50 50 90 90 90", "--out-dir", "o"],  # independent
    ["--images", "a.cbf", "b.cbf", "--model", "-cell 50 50 50 90 90 90", "--joint"],          # joint
    ["--images", "a.cbf", "b.cbf", "--model", "-cell 50 50 50 90 90 90", "--rotation-series"],
    ["--images", "a.cbf", "b.cbf", "--model", "-cell 50 50 50 90 90 90", "--joint", "--screen"],  # serial
    ["--expt", "many.expt", "--refl", "many.refl", "--joint"],                           # the stills of one file
])
def test_every_mode_gets_the_device_of_its_local_rank(monkeypatch, argv):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert parse_args([*argv, "--device", "cuda"]).compute.device == "cuda:3"
    assert parse_args([*argv, "--device", "cuda:0,cuda:1"]).compute.device == "cuda:1"
    assert parse_args(argv).compute.device == "cpu"


def test_a_gpu_not_there_refused_at_the_door(refine_cli, monkeypatch, tmp_path):
    """Under torchrun with more local processes than GPUs: one line, exit 2, nothing written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    r = refine_cli("--problem", "cubic_mosflm", "--size", "32", "--device", "cuda")
    assert r.code == 2 and r.err.count("\n") == 1, r.err
    assert "--device cuda: cuda:1 (local rank 1) is not on this machine, which has 1 GPUs (cuda:0..cuda:0)" in r.err
    assert list(tmp_path.iterdir()) == []
