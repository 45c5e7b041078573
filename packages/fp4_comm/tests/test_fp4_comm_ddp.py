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


OVERFLOW_STEP = 2


def _train_with_grad_scaler(comms, codec, steps):
    """DDP + the FP4 hook with error feedback + torch.amp.GradScaler; rank 0's input overflows
    at OVERFLOW_STEP.  Returns the steps the scaler skipped, the final scale, whether each
    step's gradients were finite, the blocks reset, the warnings and the weights."""
    import warnings

    comm = comms[2]
    if comm is None:
        return None
    comm.error_feedback.reset()
    model = DDP(_model(), process_group=comm.transport.group)
    ddp.register(model, comm, codec=codec, error_feedback=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    g = torch.Generator().manual_seed(200 + comm.rank)
    skipped, finite = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            x = torch.randn(5, IN_FEATURES, generator=g)
            if step == OVERFLOW_STEP and comm.rank == 0:
                x[0, 0] = float("inf")  # one overflowing batch on one rank
            opt.zero_grad()
            scaler.scale(model(x).square().sum()).backward()
            finite.append(all(torch.isfinite(p.grad).all().item() for p in model.parameters()))
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() < scale:
                skipped.append(step)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    residuals_finite = all(
        torch.isfinite(comm.error_feedback.residual(name, hop)).all().item()
        for name in comm.error_feedback.names()
        for hop in ("worker", "server")
    )
    dist.barrier(comm.transport.group)
    return {
        "skipped": skipped,
        "scale": scaler.get_scale(),
        "finite": finite,
        "reset": comm.error_feedback.nonfinite_blocks(),
        "warnings": messages,
        "weights": weights,
        "residuals_finite": residuals_finite,
    }


@pytest.mark.parametrize("codec", ["nvfp4", "mxfp4", "fp4quant", "none"])
def test_ddp_hook_recovers_after_one_overflowing_step(cluster, codec):
    # Error feedback is on by default in the hook: one Inf must cost one skipped step, not
    # every step after it (a NaN residual added to every later gradient).
    import fp4_kernels

    spec = fp4_kernels.FP4Quant(32) if codec == "fp4quant" else codec
    steps = OVERFLOW_STEP + 4
    out = cluster.run(_train_with_grad_scaler, spec, steps)[:2]
    for r in out:
        assert r["skipped"] == [OVERFLOW_STEP], r["finite"]
        assert r["scale"] == 512.0
        assert r["finite"] == [step != OVERFLOW_STEP for step in range(steps)]
        assert r["residuals_finite"]
        assert r["reset"] > 0  # counted on every rank (the server residual of the NaN sum)
        assert any("held NaN or Inf" in m and "reset to 0" in m for m in r["warnings"])
    assert np.array_equal(out[0]["weights"], out[1]["weights"])
    assert np.isfinite(out[0]["weights"]).all()


def _relative_errors(comms, two_models):
    """Per step, the relative error of the hook's averaged gradients (NVFP4, error feedback)
    against the float32 mean of the ranks' local gradients: of a two-layer model whose one
    bucket DDP rebuilds after the first step in gradient-ready order, and with ``two_models``
    of a second model registered on the same communicator."""
    comm = comms[2]
    if comm is None:
        return None
    comm.error_feedback.reset()
    group = comm.transport.group

    def make():
        # layer 0's gradients ~1e4 times layer 1's: a residual added to the other layer's
        # gradient shows
        torch.manual_seed(1)
        m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))
        with torch.no_grad():
            m[0].weight.mul_(1e-4)
            m[0].bias.zero_()
        return m

    models = [DDP(make(), process_group=group) for _ in range(2 if two_models else 1)]
    for m in models:
        ddp.register(m, comm, codec="nvfp4", error_feedback=True)
    references = [make() for _ in models]
    errors = []
    for step in range(4):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * step + comm.rank))
        xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * step + r))
              for r in range(2)]  # fmt: skip
        x, xs = x * 1e4, [xr * 1e4 for xr in xs]
        for m, ref in zip(models, references, strict=True):
            m.zero_grad()
            m(x).square().sum().backward()
            ref.zero_grad()
            for xr in xs:
                ref(xr).square().sum().backward()  # the sum of the ranks' local gradients
            for p, q in zip(m.module.parameters(), ref.parameters(), strict=True):
                exact = q.grad / 2
                errors.append(float((p.grad - exact).norm() / exact.norm()))
    names = comm.error_feedback.names()
    dist.barrier(group)
    return errors, names


@pytest.mark.parametrize("two_models", [False, True])
def test_ddp_residuals_follow_the_bucket_layout_and_the_registration(cluster, two_models):
    """A residual kept for one layout of a bucket was added to the rebuilt bucket's other
    layout (layer 1's gradient 2e3 times off at step 1), and a second model on the same
    communicator shared the first's residuals (1e3 times off on every step)."""
    for errors, names in cluster.run(_relative_errors, two_models)[:2]:
        assert max(errors) < 0.5, errors  # NVFP4's error with its residual: ~0.1
        assert len(names) == (2 if two_models else 1), names  # one bucket a model, in use
        assert len({n.split("_")[0] for n in names}) == len(names)  # ddp0_..., ddp1_...


def _wrong_group(comms):
    model = DDP(_model())  # over every rank of the world
    comm = comms[2]  # ranks 0 and 1 only
    if comm is None:
        return None
    try:
        ddp.register(model, comm)
    except ValueError as err:
        return str(err)
    return "registered"


def test_ddp_register_refuses_a_communicator_of_other_ranks(cluster):
    for message in cluster.run(_wrong_group)[:2]:
        assert "comm: its ranks [0, 1] are not DDP's process group's" in message, message


def _swapped_state(comms):
    comm = comms[2]
    if comm is None:
        return None
    mine = comm.state_dict()
    box = [mine]
    dist.broadcast_object_list(box, src=0, group=comm.transport.group)  # rank 0's state
    try:
        comm.load_state_dict(box[0])
    except ValueError as err:
        return str(err)
    comm.load_state_dict(mine)
    return "loaded"


def test_a_communicator_refuses_another_ranks_state(cluster):
    out = cluster.run(_swapped_state)[:2]
    assert out[0] == "loaded"
    assert "the state of rank 0 of 2, on rank 1 of 2" in out[1], out[1]
