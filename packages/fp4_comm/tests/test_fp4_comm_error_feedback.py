"""ErrorFeedback's bookkeeping: residual 0 at first, x + e afterwards, updated in place, kept
per (name, hop), reset, a clear error when a buffer changes size, blocks that held NaN/Inf
restarting from 0, and state_dict / load_state_dict (also the Communicator's, over gloo: a
resumed run continues with the very same bits)."""

import pytest
import torch

import fp4_comm
from fp4_comm import ErrorFeedback


def test_first_correction_is_the_payload_itself_as_a_new_float32_tensor():
    ef = ErrorFeedback()
    x = torch.arange(6, dtype=torch.bfloat16)
    c = ef.corrected("g", "worker", x)
    assert c.dtype == torch.float32 and torch.equal(c, x.float())
    x32 = torch.arange(6.0)
    c32 = ef.corrected("g", "worker", x32)
    assert c32.data_ptr() != x32.data_ptr()  # the caller's tensor is never modified


def test_residual_is_added_and_updated_in_place():
    ef = ErrorFeedback()
    x = torch.tensor([1.0, 2.0, 3.0])
    ef.store("g", "worker", ef.corrected("g", "worker", x), torch.tensor([1.0, 1.5, 4.0]))
    e = ef.residual("g")
    assert torch.equal(e, torch.tensor([0.0, 0.5, -1.0]))
    c = ef.corrected("g", "worker", x)
    assert torch.equal(c, torch.tensor([1.0, 2.5, 2.0]))
    ef.store("g", "worker", c, torch.tensor([1.0, 2.0, 2.0]))
    assert ef.residual("g") is e and torch.equal(e, torch.tensor([0.0, 0.5, 0.0]))
    assert ef.residual("g", "server") is None


def test_names_reset_and_size_mismatch():
    ef = ErrorFeedback()
    for name in ("a", "b"):
        ef.store(name, "worker", ef.corrected(name, "worker", torch.ones(4)), torch.zeros(4))
    ef.store("a", "server", ef.corrected("a", "server", torch.ones(2)), torch.zeros(2))
    assert ef.names() == ["a", "b"]
    with pytest.raises(ValueError, match="reset"):
        ef.corrected("a", "worker", torch.ones(5))
    ef.reset("a")
    assert ef.names() == ["b"] and ef.residual("a", "server") is None
    ef.reset()
    assert ef.names() == []


def test_a_block_that_held_nan_or_inf_restarts_from_residual_zero():
    ef = ErrorFeedback()
    x = torch.arange(1.0, 13.0).reshape(1, 12)  # three blocks of 4
    x[0, 5] = float("inf")
    decoded = torch.full_like(x, 0.5)
    decoded[0, 4:8] = float("nan")  # a block with a non-finite element decodes to NaN
    with pytest.warns(RuntimeWarning, match=r"'g' \(worker\): 1 block\(s\) of 4 held NaN or Inf"):
        ef.store("g", "worker", ef.corrected("g", "worker", x), decoded, block_size=4)
    e = ef.residual("g")
    assert torch.isfinite(e).all()
    assert torch.equal(e[0, 4:8], torch.zeros(4))  # reset, the whole block
    assert torch.equal(e[0, :4], x[0, :4] - 0.5) and torch.equal(e[0, 8:], x[0, 8:] - 0.5)
    assert ef.nonfinite_blocks("g") == 1 and ef.nonfinite_blocks() == 1
    # the next payload of that block starts afresh; the others keep their residual
    y = torch.ones(1, 12)
    c = ef.corrected("g", "worker", y)
    assert torch.isfinite(c).all() and torch.equal(c[0, 4:8], torch.ones(4))
    ef.store("g", "worker", c, c.clone(), block_size=4)
    assert ef.nonfinite_blocks("g") == 1  # a finite step adds nothing
    ef.reset("g")
    assert ef.nonfinite_blocks() == 0


def test_a_nan_residual_of_a_finite_input_is_reset_too():
    # e.g. FP4Quant marks a group NaN whose transform overflows float32, the input finite
    ef = ErrorFeedback()
    x = torch.ones(2, 4)
    decoded = torch.ones(2, 4)
    decoded[1, 0] = float("nan")
    with pytest.warns(RuntimeWarning):
        ef.store("g", "server", ef.corrected("g", "server", x), decoded, block_size=2)
    assert torch.equal(ef.residual("g", "server"), torch.zeros(2, 4))
    assert ef.nonfinite_blocks("g") == 1


def _trained(ef, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for name, hop, shape in (("a", "worker", (2, 32)), ("a", "server", (1, 32)),
                                 ("b", "worker", (4, 16))):  # fmt: skip
            x = torch.randn(shape, generator=g)
            c = ef.corrected(name, hop, x)
            ef.store(name, hop, c, (c * 4).round() / 4, block_size=16)
    return ef


def test_state_dict_round_trip_is_bit_identical_and_a_copy():
    import io

    ef = _trained(ErrorFeedback(), 3)
    state = ef.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    saved = {k: v.clone() for k, v in ef._residuals.items()}
    _trained(ef, 2, seed=1)  # the live residuals change in place; the state_dict must not
    assert all(torch.equal(state["residuals"][n][h], saved[(n, h)]) for n, h in saved)
    buf.seek(0)
    fresh = ErrorFeedback()
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert fresh.names() == ["a", "b"]
    for (n, h), e in saved.items():
        assert torch.equal(fresh.residual(n, h).view(torch.int32), e.view(torch.int32))
    # continuing from the loaded state gives the same bits as continuing the original
    again = ErrorFeedback()
    again.load_state_dict(state)
    _trained(again, 2, seed=1)
    for key, e in ef._residuals.items():
        assert torch.equal(again._residuals[key].view(torch.int32), e.view(torch.int32))


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([], ValueError, "'residuals' and 'nonfinite_blocks'"),
        ({"residuals": {}}, ValueError, "'residuals' and 'nonfinite_blocks'"),
        ({"residuals": [], "nonfinite_blocks": {}}, TypeError, "residuals is list"),
        ({"residuals": {"a": {"up": torch.zeros(1)}}, "nonfinite_blocks": {}}, ValueError,
         "should map hops"),
        ({"residuals": {"a": {"worker": torch.zeros(1, dtype=torch.float64)}},
          "nonfinite_blocks": {}}, TypeError, "not a float32 tensor"),
        ({"residuals": {"a": {"worker": [0.0]}}, "nonfinite_blocks": {}}, TypeError,
         "not a float32 tensor"),
        ({"residuals": {"a": {"worker": torch.zeros(1)}},
          "nonfinite_blocks": {"a": {"worker": -1}}}, TypeError, "not a count"),
        ({"residuals": {}, "nonfinite_blocks": {"a": {"worker": 1}}}, ValueError,
         "has no residual"),
    ],
)  # fmt: skip
def test_load_state_dict_rejects_what_state_dict_cannot_have_made(state, error, match):
    ef = _trained(ErrorFeedback(), 1)
    before = ef.state_dict()
    with pytest.raises(error, match=match):
        ef.load_state_dict(state)
    after = ef.state_dict()  # nothing was replaced
    assert before["nonfinite_blocks"] == after["nonfinite_blocks"]
    for n, hops in before["residuals"].items():
        for h, e in hops.items():
            assert torch.equal(after["residuals"][n][h], e)


def _resume(comms, codec, rounding, k, m):
    """k steps, save, m more steps; then a new communicator loads the saved state and runs the
    same m steps: both continuations, and a third one from a fresh communicator without it."""
    import io

    comm = comms[2]
    if comm is None:
        return None
    group = comm.transport.group
    fresh = [fp4_comm.Communicator.from_process_group(group, "cpu", 30.0) for _ in range(2)]
    first, resumed, unloaded = fresh[0], fresh[1], None
    g = torch.Generator().manual_seed(300 + comm.rank)
    inputs = [torch.randn(3, 50, generator=g) for _ in range(k + m)]

    def step(c, x):
        a = c.all_reduce(x, codec=codec, rounding=rounding, error_feedback="grads")
        b = c.reduce_scatter(x, codec=codec, rounding=rounding, error_feedback="acts")
        return torch.cat([a.reshape(-1), b.reshape(-1)]).view(torch.int32)

    for x in inputs[:k]:
        step(first, x)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    cont = [step(first, x) for x in inputs[k:]]
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    again = [step(resumed, x) for x in inputs[k:]]
    unloaded = fp4_comm.Communicator.from_process_group(group, "cpu", 30.0)
    without = [step(unloaded, x) for x in inputs[k:]]
    return (
        all(torch.equal(a, b) for a, b in zip(cont, again, strict=True)),
        all(torch.equal(a, b) for a, b in zip(cont, without, strict=True)),
    )


@pytest.mark.parametrize(("codec", "rounding"), [("nvfp4", "nearest"), ("mxfp4", "stochastic")])
def test_communicator_state_dict_resumes_bit_identically(cluster, codec, rounding):
    for same, same_without_state in cluster.run(_resume, codec, rounding, 3, 3)[:2]:
        assert same
        assert not same_without_state  # the residuals (and the step counter) matter


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("codec", ["none-float32", "none-float16", "none"])
def test_error_feedback_over_a_none_codec_sums_the_values(op, codec):
    # A float32 wire encodes the float32 corrected payload as the very same memory; storing
    # the residual (corrected - decoded, in place) must not zero what goes on the wire.
    from fp4_comm import reference

    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(4, 6, generator=gen) for _ in range(2)]
    residuals = [ErrorFeedback(), ErrorFeedback()]
    got = getattr(reference, op)(xs, codec=codec, error_feedback="g", residuals=residuals)
    want = getattr(reference, op)(xs, codec=codec)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    if codec == "none-float32":  # lossless: the sum itself, and residual 0
        total = xs[0] + xs[1]
        full = torch.cat(got) if op == "reduce_scatter" else got[0]
        assert torch.equal(full, total)
        for ef in residuals:
            assert not ef.residual("g").any()


def test_store_checks_before_it_changes_anything():
    """A bad block size or hop stored the residual but not its count; state_dict() then
    raised KeyError."""
    import pytest
    import torch

    from fp4_comm import ErrorFeedback

    ef = ErrorFeedback()
    for kwargs, message in (
        ({"block_size": 0}, "block_size: a positive int"),
        ({"block_size": 5}, "no whole number of blocks of 5"),
        ({"hop": "middle"}, "hop: 'middle' is not one of"),
    ):
        args = {"name": "b", "hop": "worker", "block_size": 16, **kwargs}
        with pytest.raises(ValueError, match=message):
            ef.store(args["name"], args["hop"], torch.ones(64), torch.zeros(64), args["block_size"])
        assert ef.names() == [] and ef.state_dict() == ErrorFeedback().state_dict()


def test_store_refuses_what_would_break_its_state_before_changing_it():
    """A transposed corrected raised torch's view error after the residual was kept without
    its count (state_dict() and every later store failed); a decoded of another shape was
    broadcast into a wrong residual; a residual of another shape was resized in place; a
    float16 residual did not load back; a non-str name broke names()."""
    ef = ErrorFeedback()
    ok = torch.zeros(16, 32)
    cases = [
        (lambda: ef.store("a", "worker", torch.randn(32, 16).t(), ok, 16), "not contiguous"),
        (lambda: ef.store("a", "worker", torch.randn(16, 32).half(), ok, 16), "torch.float16"),
        (lambda: ef.store("a", "worker", torch.randn(16, 32), torch.zeros(32), 16),
         r"decoded has shape \(32,\), corrected \(16, 32\)"),
        (lambda: ef.store(1, "worker", torch.randn(16, 32), ok, 16), "name: a buffer name"),
    ]  # fmt: skip
    for call, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            call()
        assert ef.names() == [] and ef.state_dict()["residuals"] == {}
    ef.store("a", "worker", torch.ones(16, 32), ok, 16)
    with pytest.raises(ValueError, match=r"residual has shape \(16, 32\), this call \(8, 32\)"):
        ef.store("a", "worker", torch.ones(8, 32), torch.zeros(8, 32), 16)
    assert torch.equal(ef.residual("a", "worker"), torch.ones(16, 32))
    ef.reset("a")  # after a reset, a payload of another shape replaces the residual
    ef.store("a", "worker", torch.ones(8, 32), torch.zeros(8, 32), 16)
    assert ef.residual("a", "worker").shape == (8, 32)
    ErrorFeedback().load_state_dict(ef.state_dict())
