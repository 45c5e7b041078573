"""fp4_comm.local_device: rank r of a node on GPU r % (GPU count), and the notice when ranks
share GPUs (torch.cuda stood in for: no GPU is needed)."""

import logging

import pytest
import torch

import fp4_comm
from fp4_comm import devices


@pytest.fixture
def gpus(monkeypatch):
    def set_count(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(devices, "_NOTIFIED", [])

    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", devices.MULTI_RANK_ENV):
        monkeypatch.delenv(name, raising=False)
    return set_count


@pytest.mark.parametrize(("rank", "count", "index"), [(0, 1, 0), (3, 1, 0), (3, 2, 1), (5, 8, 5)])
def test_rank_modulo_the_gpu_count(gpus, monkeypatch, rank, count, index):
    gpus(count)
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    assert fp4_comm.local_device() == torch.device("cuda", index)
    assert fp4_comm.local_device(rank) == torch.device("cuda", index)


def test_local_rank_defaults_to_zero(gpus):
    gpus(2)
    assert fp4_comm.local_device() == torch.device("cuda", 0)


def test_one_notice_when_ranks_share_a_gpu(gpus, monkeypatch, caplog):
    gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv(devices.MULTI_RANK_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="fp4_comm"):
        for rank in (0, 1, 0):
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            fp4_comm.local_device()
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == 1 and "\n" not in notices[0]
    assert "4 ranks share 1 GPU" in notices[0] and "multi-rank mode is on" in notices[0]


def test_notice_names_the_nccl_switch_where_it_is_off(gpus):
    gpus(2)
    assert f"{devices.MULTI_RANK_ENV}=1" in devices.sharing_notice(4, 2)


def test_no_notice_with_a_gpu_per_rank(gpus, monkeypatch, caplog):
    gpus(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with caplog.at_level(logging.WARNING, logger="fp4_comm"):
        fp4_comm.local_device()
    assert not caplog.records


@pytest.mark.parametrize("value", ["x", "-1", "1.5"])
def test_bad_local_rank_is_named(gpus, monkeypatch, value):
    gpus(1)
    monkeypatch.setenv("LOCAL_RANK", value)
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        fp4_comm.local_device()


def test_no_gpu_is_an_error(gpus):
    gpus(0)
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        fp4_comm.local_device()


def test_from_env_puts_rank_3_of_a_one_gpu_node_on_that_gpu(gpus, monkeypatch):
    import torch.distributed as dist

    from fp4_comm.communicator import Communicator

    gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    made = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    monkeypatch.setattr(
        Communicator, "from_process_group", classmethod(lambda cls, g, device, *a: device)
    )
    assert Communicator.from_env() == torch.device("cuda", 0) and made == [torch.device("cuda", 0)]


@pytest.mark.parametrize(
    ("ranks", "count", "version", "env", "missing"),
    [
        (2, 2, 22809, None, None),  # a GPU a rank: any NCCL
        (4, 1, 23000, "1", None),  # shared, and NCCL's multi-rank mode is on
        (4, 1, 22809, "1", ["NCCL >= 2.30 (this is 22809)"]),
        (4, 1, 23000, None, ["NCCL_MULTI_RANK_GPU_ENABLE=1"]),
        (3, 2, 22809, "0", ["NCCL >= 2.30 (this is 22809)", "NCCL_MULTI_RANK_GPU_ENABLE=1"]),
    ],
)
def test_sharing_problem_names_what_is_missing(gpus, monkeypatch, ranks, count, version, env,
                                              missing):  # fmt: skip
    gpus(count)
    if env is not None:
        monkeypatch.setenv(devices.MULTI_RANK_ENV, env)
    problem = devices.sharing_problem(ranks, nccl_version=version)
    if missing is None:
        assert problem is None
    else:
        assert problem.startswith(f"{ranks} ranks on {count} GPU"), problem
        assert problem.endswith(" with ".join(missing)), problem
