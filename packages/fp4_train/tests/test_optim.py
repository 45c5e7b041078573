"""FP4StoredWeights: packed storage, the three roundings, memory, checkpoints, errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from _oracle import U32, requires_cuda

import fp4_kernels
from fp4_train import FP4StoredWeights


def _grid_weight(rows=64, k=32, seed=0):
    """MXFP4 weights on the unit e2m1 grid: every 32-element row holds 6 (scale 2^0) and
    values in {0.5, 1, 1.5}, whose grid step is 0.5."""
    rng = np.random.default_rng(seed)
    w = rng.choice(np.float32([0.5, 1.0, 1.5]), size=(rows, k))
    w[:, 0] = 6.0
    return torch.nn.Parameter(torch.from_numpy(w))


def _sgd(p, rounding, lr, **kw):
    return FP4StoredWeights(torch.optim.SGD([p], lr=lr), rounding=rounding, fmt="mxfp4", **kw)


def _constant_step(opt, p, grad_value):
    opt.materialize()
    p.grad = torch.full_like(p, grad_value)
    opt.step()
    opt.materialize()


def test_weights_are_packed_and_released_between_steps():
    p = torch.nn.Parameter(torch.randn(32, 64))
    w0 = p.detach().clone()
    opt = FP4StoredWeights(torch.optim.SGD([p], lr=0.1), rounding="nearest")
    assert p.numel() == 0  # released: only the packed copy remains
    report = opt.memory_report()
    # 2048 weights: 1024 bytes of codes, 128 e4m3 scales, one float32 tensor scale
    assert report["packed_bytes"] == 1024 + 128 + 4
    assert report["float32_bytes"] == 4 * 2048 and report["resident_weight_bytes"] == 0
    opt.materialize()
    assert torch.equal(p.detach(), fp4_kernels.quantize_dequantize(w0))


def test_nearest_loses_every_sub_step_update():
    p = _grid_weight()
    w0 = p.detach().clone()
    opt = _sgd(p, "nearest", lr=0.05)  # update 0.05 = a tenth of the grid step 0.5
    for _ in range(20):
        _constant_step(opt, p, -1.0)
    assert torch.equal(p.detach(), w0)


def test_error_feedback_accumulates_sub_step_updates_exactly():
    # decoded + residual = w0 + sum of updates, up to the float32 rounding of each step's
    # w + update and (w + update) + residual
    p = _grid_weight()
    w0 = p.detach().double().clone()
    opt = _sgd(p, "error_feedback", lr=0.05)
    steps = 20
    for _ in range(steps):
        _constant_step(opt, p, -1.0)
    residual = opt._error_feedback.residual("param0").view_as(p).double()
    target = w0 + steps * 0.05
    err = (p.detach().double() + residual - target).abs()
    assert bool((err <= 2 * steps * U32 * target.abs().max()).all())
    moved = p.detach().double() - w0
    assert bool((moved[:, 1:] > 0).all())  # 1.0 accumulated: every weight crossed a grid point


def test_stochastic_moves_a_tenth_of_the_weights_by_one_step():
    p = _grid_weight(rows=256)
    w0 = p.detach().clone()
    opt = _sgd(p, "stochastic", lr=0.05, seed=5)
    _constant_step(opt, p, -1.0)
    moved = (p.detach() != w0)[:, 1:]
    n = moved.numel()
    # each weight moves up one step with probability 0.1 (binomial: 6 sigma)
    assert abs(moved.sum().item() - 0.1 * n) <= 6 * np.sqrt(n * 0.1 * 0.9)
    assert bool(((p.detach() - w0)[:, 1:][moved] == 0.5).all())


def _regression(seed=0, n=256, d=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w_true = torch.randn(16, d, generator=g)
    return x, x @ w_true.T


def _adamw_regression_losses(rounding, steps=60):
    x, y = _regression()
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16, bias=False)
    opt = FP4StoredWeights(torch.optim.AdamW(model.parameters(), lr=0.05), rounding=rounding)
    opt.attach(model)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


@pytest.mark.parametrize("rounding", ["stochastic", "error_feedback"])
def test_adamw_trains_a_regression_with_unbiased_rounding(rounding):
    losses = _adamw_regression_losses(rounding)
    assert losses[-1] < 0.1 * losses[0]


def test_adamw_with_nearest_rounding_stalls():
    # the same run under round to nearest: updates below half a grid step are lost
    losses = _adamw_regression_losses("nearest")
    assert losses[-1] > 0.25 * losses[0]
    assert losses[-1] > 4 * _adamw_regression_losses("error_feedback")[-1]


def test_state_dict_round_trip_continues_identically():
    x, y = _regression(1)

    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 16)
        opt = FP4StoredWeights(
            torch.optim.AdamW(model.parameters(), lr=0.01), rounding="error_feedback"
        )
        return model, opt.attach(model) and opt

    def train(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    model_a, opt_a = make()
    train(model_a, opt_a, 6)
    model_b, opt_b = make()
    train(model_b, opt_b, 3)
    saved = opt_b.state_dict()
    model_c, opt_c = make()
    opt_c.load_state_dict(saved)
    train(model_c, opt_c, 3)
    opt_a.materialize()
    opt_c.materialize()
    for pa, pc in zip(model_a.parameters(), model_c.parameters(), strict=True):
        assert torch.equal(pa, pc)


def _mlp(seed=0):
    # 20 outputs: the second weight (20 x 48) and bias (20) are padded to whole NVFP4 blocks
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 20))


def _train_mlp(model, opt, steps, data_seed=0):
    g = torch.Generator().manual_seed(data_seed)
    for _ in range(steps):
        x, y = torch.randn(64, 32, generator=g), torch.randn(64, 20, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _fp4_weights(state, fmt="nvfp4"):
    """What FP4StoredWeights(rounding="nearest") stores for each tensor of ``state``:
    flattened, zero-padded to whole blocks, quantized-dequantized, cut back to shape."""
    out = {}
    for k, w in state.items():
        flat = w.reshape(-1).float()
        flat = torch.nn.functional.pad(flat, (0, -flat.numel() % fp4_kernels.FORMATS[fmt]))
        qdq = fp4_kernels.quantize_dequantize(flat, fmt=fmt)
        out[k] = qdq[: w.numel()].view(w.shape).to(w.dtype)
    return out


def test_module_state_dict_holds_the_decoded_weights_and_loads_anywhere():
    model = _mlp()
    opt = FP4StoredWeights(torch.optim.AdamW(model.parameters(), lr=0.01), seed=3)
    opt.attach(model)
    _train_mlp(model, opt, 3)
    assert all(p.numel() == 0 for p in model.parameters())  # released between steps
    saved = _save_load(model.state_dict())
    assert all(p.numel() == 0 for p in model.parameters())  # and released again after saving
    opt.materialize()
    for name, p in model.named_parameters():
        assert torch.equal(saved[name], p.detach())
    x = torch.randn(8, 32)
    expected = model(x)

    plain = _mlp(seed=1)  # another initialization, then the checkpoint
    plain.load_state_dict(saved)
    assert torch.equal(plain(x), expected)

    fresh = _mlp(seed=2)
    fresh_opt = FP4StoredWeights(torch.optim.SGD(fresh.parameters(), lr=0.1), rounding="nearest")
    fresh_opt.attach(fresh)
    fresh.load_state_dict(saved)
    assert all(p.numel() == 0 for p in fresh.parameters())  # stored in FP4, released
    reference = _mlp()
    reference.load_state_dict(_fp4_weights(saved))
    assert torch.equal(fresh(x), reference(x))


def test_module_state_dict_saves_with_safetensors():
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = _mlp()
    opt = FP4StoredWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.attach(model)
    _train_mlp(model, opt, 2)
    blob = safetensors_torch.save(model.state_dict())
    plain = _mlp(seed=1)
    plain.load_state_dict(safetensors_torch.load(blob))
    opt.materialize()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)


def test_keep_vars_returns_the_live_materialized_parameters():
    model = _mlp()
    opt = FP4StoredWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.attach(model)
    state = model.state_dict(keep_vars=True)
    assert state["0.weight"] is model[0].weight and state["0.weight"].shape == (48, 32)
    assert state["2.bias"].shape == (20,)


@pytest.mark.parametrize("rounding", ["stochastic", "error_feedback"])
@pytest.mark.parametrize("order", ["model_first", "optimizer_first"])
def test_model_and_optimizer_checkpoints_resume_bit_for_bit(rounding, order):
    def make():
        model = _mlp()
        opt = FP4StoredWeights(
            torch.optim.AdamW(model.parameters(), lr=0.01), rounding=rounding, seed=7
        )
        return model, opt.attach(model) and opt

    model_a, opt_a = make()
    _train_mlp(model_a, opt_a, 3)
    model_state = _save_load(model_a.state_dict())
    opt_state = _save_load(opt_a.state_dict())
    _train_mlp(model_a, opt_a, 3, data_seed=1)

    model_b, opt_b = make()
    if order == "model_first":
        model_b.load_state_dict(model_state)
        opt_b.load_state_dict(opt_state)
    else:
        opt_b.load_state_dict(opt_state)
        model_b.load_state_dict(model_state)
    _train_mlp(model_b, opt_b, 3, data_seed=1)
    for qa, qb in zip(opt_a.packed, opt_b.packed, strict=True):
        assert torch.equal(qa.data, qb.data) and torch.equal(qa.scales, qb.scales)
        assert torch.equal(qa.global_scale, qb.global_scale)


def test_loading_changed_weights_restarts_their_residual():
    model = _mlp()
    opt = FP4StoredWeights(torch.optim.SGD(model.parameters(), lr=0.1), rounding="error_feedback")
    opt.attach(model)
    _train_mlp(model, opt, 2)
    state = model.state_dict()
    state["0.weight"] = torch.full((48, 32), 0.3)
    model.load_state_dict(state)
    opt.materialize()
    # stored from 0.3 alone (round to nearest, no old residual), the others kept as they were
    assert torch.equal(model[0].weight, _fp4_weights({"w": torch.full((48, 32), 0.3)})["w"])
    residual = opt._error_feedback.residual("param0")[: 48 * 32].view(48, 32)
    assert torch.equal(residual, torch.full((48, 32), 0.3) - model[0].weight)
    assert torch.equal(model[2].weight, state["2.weight"])


def test_load_state_dict_with_assign_is_refused():
    model = _mlp()
    FP4StoredWeights(torch.optim.SGD(model.parameters(), lr=0.1)).attach(model)
    with pytest.raises(ValueError, match=r"assign=True\) would replace the parameters"):
        model.load_state_dict(_mlp(seed=1).state_dict(), assign=True)


def test_restoring_into_another_shape_is_a_clear_error():
    opt = FP4StoredWeights(torch.optim.SGD(torch.nn.Linear(32, 16).parameters(), lr=0.1))
    other = FP4StoredWeights(torch.optim.SGD(torch.nn.Linear(16, 32).parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"parameter 0 has shape \(32, 16\) here but \(16, 32\)"):
        other.load_state_dict(opt.state_dict())


def test_odd_sized_parameters_are_padded_to_whole_blocks():
    p = torch.nn.Parameter(torch.randn(3, 5))  # 15 elements: one NVFP4 block with padding
    opt = FP4StoredWeights(torch.optim.SGD([p], lr=0.1), rounding="nearest", release=False)
    assert p.shape == (3, 5) and opt.packed[0].shape == (16,)


def test_unknown_rounding_is_rejected():
    with pytest.raises(ValueError, match="rounding"):
        FP4StoredWeights(torch.optim.SGD([torch.nn.Parameter(torch.ones(16))], lr=1), rounding="up")


@pytest.mark.gpu
@requires_cuda
def test_release_frees_device_memory():
    model = torch.nn.Linear(4096, 4096, bias=False, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt = FP4StoredWeights(torch.optim.SGD(model.parameters(), lr=0.1), rounding="stochastic")
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    # 64 MiB of float32 weights replaced by 8 MiB of codes + 1 MiB of scales + the tensor
    # scale: fp4_kernels returns it as a view of its one float32 scratch buffer (the scale and
    # the amax pass's per-CTA partials, at most 8 per SM), which stays allocated with it:
    # at most 1 + 8 * 132 floats on an H200, rounded up to the allocator's 512-byte blocks.
    # (Measured on the H200: 57,667,072 bytes freed, the scratch taking 4,608.)
    scratch = -(-4 * (1 + 8 * torch.cuda.get_device_properties(0).multi_processor_count) // 512)
    assert before - after >= 4 * 4096 * 4096 - (4096 * 4096 // 2 + 4096 * 256 + 512 * scratch)
    assert opt.memory_report()["resident_weight_bytes"] == 0


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rounding", ["stochastic", "error_feedback"])
def test_cuda_storage_matches_the_cpu_bit_for_bit(rounding):
    # with lr = 1 the update w - lr g is one correctly rounded subtraction per element on
    # either device (fused or not, the product with 1 is exact), and the codec is bit exact
    # across devices, so the packed weights agree after every step
    rng = np.random.default_rng(11)
    w0 = rng.standard_normal((64, 96)).astype(np.float32)
    grads = [0.01 * rng.standard_normal((64, 96)).astype(np.float32) for _ in range(3)]
    packed = {}
    for device in ("cpu", "cuda"):
        p = torch.nn.Parameter(torch.from_numpy(w0).to(device))
        opt = FP4StoredWeights(torch.optim.SGD([p], lr=1.0), rounding=rounding, seed=4)
        for g in grads:
            opt.materialize()
            p.grad = torch.from_numpy(g).to(device)
            opt.step()
        q = opt.packed[0]
        packed[device] = (q.data.cpu(), q.scales.cpu(), q.global_scale.cpu())
    for cpu_part, cuda_part in zip(packed["cpu"], packed["cuda"], strict=True):
        assert torch.equal(cpu_part, cuda_part)


@pytest.mark.parametrize("rounding", ["stochastic", "error_feedback"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_steps_without_an_update_leave_the_weights_as_stored(rounding, dtype):
    """Steps without gradients requantized every weight: a bf16 / fp16 parameter's cast of
    its FP4 value (2321 of 4096 weights moved in 100 steps, error feedback feeding the cast
    error back each step), a float32 one's stochastic re-store (1.3 % moved by one grid step)."""
    g = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(64, 64, generator=g).to(dtype))
    sw = FP4StoredWeights(torch.optim.SGD([p], lr=0.1), rounding=rounding, release=False)
    stored = p.detach().clone()
    for _ in range(20):
        sw.step()
    assert torch.equal(p.detach(), stored)
    # an update still moves it, by what the optimizer asked (against the stored FP4 values)
    p.grad = torch.full_like(p, -1.0)
    sw.step()
    assert (p.detach().float() - stored.float()).mean() > 0.05


@pytest.mark.parametrize("rounding", ["stochastic", "error_feedback"])
def test_a_bf16_parameter_accumulates_its_updates_in_float32(rounding):
    """A bf16 parameter is stored as its FP4 value plus the update in float32: its drift
    under zero-mean noise stays as small as a float32 parameter's."""
    g = torch.Generator().manual_seed(4)
    w0 = torch.randn(64, 64, generator=g)
    drift = {}
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(w0.to(dtype))
        sw = FP4StoredWeights(torch.optim.SGD([p], lr=1e-3), rounding=rounding, release=False)
        start = p.detach().float().clone()
        noise = torch.Generator().manual_seed(5)
        for _ in range(100):
            p.grad = torch.randn(p.shape, generator=noise).to(dtype)
            sw.step()
        drift[dtype] = (p.detach().float() - start).abs().mean().item()
    assert drift[torch.bfloat16] < 1.5 * drift[torch.float32] + 1e-3, drift


@pytest.mark.parametrize("release", [True, False])
def test_a_model_converted_after_wrapping_is_refused(release):
    """model.half() after wrapping was undone by the next step (float32 again) or failed in
    the forward with torch's dtype error."""
    m = torch.nn.Linear(32, 16)
    sw = FP4StoredWeights(torch.optim.SGD(m.parameters(), lr=0.1), release=release)
    sw.attach(m)
    m.half()
    with pytest.raises(ValueError, match=r"parameter 0 is torch.float16 .* stored in FP4 as "
                                         r"torch.float32.*before wrapping"):  # fmt: skip
        m(torch.ones(2, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="step: parameter 0 is torch.float16"):
        sw.step()


def test_a_dropped_wrapper_gives_its_parameters_back():
    """Dropping an unattached wrapper left its released parameters empty for good (and
    'stored by another FP4StoredWeights' when wrapped again)."""
    import gc

    m = torch.nn.Linear(32, 16)
    sw = FP4StoredWeights(torch.optim.SGD(m.parameters(), lr=0.1))
    decoded = sw._decoded(0).clone()
    assert m.weight.numel() == 0
    del sw
    gc.collect()
    assert type(m.weight) is torch.nn.Parameter and torch.equal(m.weight.detach(), decoded)
    FP4StoredWeights(torch.optim.SGD(m.parameters(), lr=0.1))  # wrapped again


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda r: r.numpy(), "ndarray; expected the torch tensor"),
        (lambda r: r.index_fill(0, torch.tensor([3]), float("nan")), "NaN or infinite"),
    ],
)
def test_a_residual_that_step_could_not_use_is_refused_at_load(change, match):
    """A numpy residual was accepted, then step() raised after the optimizer had already
    updated (momentum moved, weights not stored): every retry applied the momentum again."""
    p = torch.nn.Parameter(torch.randn(8, 32))
    sw = FP4StoredWeights(torch.optim.SGD([p], lr=0.1, momentum=0.9), rounding="error_feedback",
                          release=False)  # fmt: skip
    p.grad = torch.ones(8, 32)
    sw.step()
    state = sw.state_dict()
    state["error_feedback"]["residuals"]["param0"] = change(
        state["error_feedback"]["residuals"]["param0"]
    )
    with pytest.raises(ValueError, match=match):
        sw.load_state_dict(state)


def test_a_packed_shape_that_is_no_sequence_is_named():
    p = torch.nn.Parameter(torch.randn(8, 32))
    sw = FP4StoredWeights(torch.optim.SGD([p], lr=0.1))
    state = sw.state_dict()
    state["packed"][0]["shape"] = 256
    with pytest.raises(ValueError, match=r"state\['packed'\]\[0\]: shape 256, expected \(256,\)"):
        sw.load_state_dict(state)
