"""The DDP hook over gloo: gradients identical on every rank, equal to the float32 mean of the
local gradients where the codec is exact, and within the compressed all-reduce's error bound
otherwise."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fp4_comm import ddp
from fp4_comm.codecs import get_codec

IN_FEATURES, OUT_FEATURES = 20, 7  # 147 parameters: no multiple of 2 ranks x 16-blocks


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(IN_FEATURES, OUT_FEATURES)


def _run(comms, codec, error_feedback):
    comm = comms[2]
    if comm is None:
        return None
    group = comm.transport.group  # the gloo group of ranks 0-1
    model = DDP(_model(), process_group=group)
    ddp.register(model, comm, codec=codec, error_feedback=error_feedback)
    g = torch.Generator().manual_seed(100 + comm.rank)
    x = torch.randn(5, IN_FEATURES, generator=g)
    model(x).square().sum().backward()
    local = _model()
    local(x).square().sum().backward()
    flat = lambda m: torch.cat([p.grad.reshape(-1) for p in m.parameters()]).numpy()  # noqa: E731
    dist.barrier(group)
    return flat(model.module), flat(local)


@pytest.mark.parametrize(("codec", "error_feedback"), [("none-float32", False), ("nvfp4", True)])
def test_ddp_hook_averages_gradients(cluster, codec, error_feedback):
    out = cluster.run(_run, codec, error_feedback)[:2]
    assert np.array_equal(out[0][0], out[1][0])  # every rank steps with the same gradients
    mean = (out[0][1] + out[1][1]) / np.float32(2)
    if codec == "none-float32":
        assert np.array_equal(out[0][0], mean)
        return
    # First step: no residual yet, so the bound of one compressed all-reduce of the two local
    # gradient vectors, halved (the hook's division by the world size is exact).
    from test_fp4_comm_collectives import all_reduce_bound

    local = [torch.from_numpy(o[1]) for o in out]
    exact, bound = all_reduce_bound(local, codec, "nearest", torch.float32)
    assert (np.abs(out[0][0] - exact / 2) <= bound / 2).all()
    assert get_codec(codec).granularity == 16
