"""fp4_train.experiments.nonfinite (``--check-finite``): the first torch operation that makes
a NaN or an infinity from finite values is named with where it was called; a non-finite value
made where the mode does not look is named at its first use; a NaN in the backward is named by
anomaly detection; finite work runs unchanged, bit for bit (also a training step)."""

import math

import pytest
import torch
import torch.nn.functional as F

from fp4_train.experiments.nonfinite import NonFiniteError, check_finite


def _mlp_step(seed):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(16, 8, generator=g).requires_grad_()
    w2 = torch.randn(4, 16, generator=g).requires_grad_()
    x = torch.randn(32, 8, generator=g)
    loss = F.linear(F.silu(F.linear(x, w1)), w2).pow(2).mean()
    loss.backward()
    return [t.detach().clone() for t in (loss, w1.grad, w2.grad)]


def test_finite_work_runs_unchanged():
    plain = _mlp_step(0)
    with pytest.warns(UserWarning, match="Anomaly Detection"), check_finite():
        checked = _mlp_step(0)
    for a, b in zip(plain, checked, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("op", "name", "count"),
    [
        (lambda: torch.log(torch.tensor([-1.0, 2.0])), "torch.log", "1 of 2"),
        (lambda: torch.ones(3).div_(0.0), "Tensor.div_", "3 of 3"),  # in place
        (lambda: torch.exp(torch.full((2, 2), 100.0)), "torch.exp", "4 of 4"),  # overflow
    ],
    ids=["log", "div_", "exp"],
)
def test_first_non_finite_result_is_named_with_its_caller(op, name, count):
    with pytest.warns(UserWarning), check_finite():
        with pytest.raises(NonFiniteError, match=f"{name} made a non-finite") as err:
            op()
    message = str(err.value)
    assert count in message and "from finite arguments" in message
    assert "test_nonfinite.py" in message  # the caller's frame


def test_a_value_made_elsewhere_is_named_at_its_first_use():
    x = torch.tensor([math.nan, 1.0])  # before the checks: as another thread or a kernel would
    with pytest.warns(UserWarning), check_finite():
        with pytest.raises(NonFiniteError, match="torch.add was handed a non-finite argument"):
            torch.add(x, 1.0)
        with pytest.raises(NonFiniteError, match="from Python data"):
            torch.tensor([math.inf])


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * math.nan


class _LogShifted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.log(x - 5.0)

    @staticmethod
    def backward(ctx, g):
        return g


def test_ops_inside_a_custom_autograd_forward_are_checked():
    with pytest.warns(UserWarning), check_finite():
        with pytest.raises(NonFiniteError, match="torch.log made a non-finite"):
            _LogShifted.apply(torch.ones(2, requires_grad=True))


def test_a_nan_in_the_backward_is_named():
    x = torch.ones(3, requires_grad=True)
    with pytest.warns(UserWarning), check_finite():
        y = _NanGrad.apply(x).sum()
        with pytest.raises(RuntimeError, match="_NanGradBackward.*nan"):
            y.backward()


def test_training_with_check_finite_gives_the_same_losses(tmp_path):
    from fp4_train.experiments import tp_train
    from fp4_train.experiments.corpus import train_batch

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    base = ["--device", "cpu", "--layers", "1", "--d-model", "32", "--heads", "2",
            "--seq-len", "16", "--batch", "2", "--steps", "2", "--quiet",
            "--data", str(corpus)]  # fmt: skip
    losses = {}
    for flag in ([], ["--check-finite"]):
        args = tp_train.parse_args([*base, *flag])
        torch.set_num_threads(args.threads)
        runner = tp_train.Runner(args, None, torch.device("cpu"), 256)
        tokens, _, _ = tp_train.load_data(args)
        out = []
        for step in range(2):
            x, y = train_batch(tokens, step, args.batch, args.seq_len, args.seed)
            out.append([float(v) for v in runner.rank_values(runner.step(x, y))])
        losses[bool(flag)] = out
    assert losses[True] == losses[False]
    assert all(math.isfinite(v) for row in losses[True] for v in row)
