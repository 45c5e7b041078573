"""Bad input to every public function of fp4_comm: a clear exception (type, and a message that
names the argument) or the documented policy, on every rank; never a crash, a hang, a raw
library error or a result that silently differs from the reference.

The calls that need a process group run in the gloo cluster (conftest.py), each rank making
the same bad call, so the group stays usable; differing calls across ranks are in
test_fp4_comm_communicator.py (and mismatched arguments in test_fp4_comm_collectives.py).
"""

import itertools

import numpy as np
import pytest
import torch
from fp4_comm_cluster import construction_outcomes

import fp4_comm
import fp4_kernels
from fp4_comm import ErrorFeedback, codecs, ddp, shard_rows
from fp4_comm.nccl import NcclTransport

CODECS = ["nvfp4", "mxfp4", "none", "none-float32", fp4_kernels.FP4Quant(32)]

# ------------------------------------------------------------------ collectives, every rank


# (case, call(f, x): f is the collective, x a float32 (4, 32) tensor, exception type, words its
# message must hold): the bad arguments of every collective
_EVERY_COLLECTIVE = [
    ("float64", lambda f, x: f(x.double()), "TypeError", ["float64", "float32, bfloat16, float16"]),
    ("int32", lambda f, x: f(x.int()), "TypeError", ["int32"]),
    ("0-d", lambda f, x: f(torch.ones(())), "ValueError", ["0-d"]),
    ("meta", lambda f, x: f(torch.ones(4, 32, device="meta")), "ValueError",
     ["meta", "communicator on cpu"]),
    ("numpy", lambda f, x: f(np.ones((4, 32), np.float32)), "TypeError",
     ["torch tensor or a CuPy array", "ndarray"]),
    ("list", lambda f, x: f([1.0, 2.0]), "TypeError", ["torch tensor or a CuPy array", "list"]),
    ("nested", lambda f, x: f(_nested()), "TypeError", ["nested", "torch.nested.to_padded_tensor"]),
    ("sparse", lambda f, x: f(x.to_sparse()), "TypeError", ["torch.sparse_coo", ".to_dense()"]),
    ("codec fp5", lambda f, x: f(x, codec="fp5"), "ValueError", ["codec", "'fp5'", "'nvfp4'"]),
    ("codec none-fp16", lambda f, x: f(x, codec="none-fp16"), "ValueError",
     ["codec", "'none-fp16'", "'none-float16'"]),
    ("codec none-bf16", lambda f, x: f(x, codec="none-bf16"), "ValueError",
     ["codec", "'none-bf16'", "'none-bfloat16'"]),
    ("codec none-", lambda f, x: f(x, codec="none-"), "ValueError",
     ["codec", "'none-'", "'none-float32'"]),
    ("codec 4", lambda f, x: f(x, codec=4), "ValueError", ["codec", "4"]),
    ("codec None", lambda f, x: f(x, codec=None), "ValueError", ["codec", "None"]),
    ("rounding up", lambda f, x: f(x, rounding="up"), "ValueError",
     ["rounding", "'up'", "nearest"]),
    ("rounding None", lambda f, x: f(x, rounding=None), "ValueError", ["rounding", "None"]),
    ("seed -1", lambda f, x: f(x, seed=-1), "ValueError", ["seed", "-1", "[0, 2**64)"]),
    ("seed 2**64", lambda f, x: f(x, seed=2**64), "ValueError", ["seed", "[0, 2**64)"]),
    ("seed 1.5", lambda f, x: f(x, seed=1.5), "TypeError", ["seed", "integer", "float"]),
    ("seed '1'", lambda f, x: f(x, seed="1"), "TypeError", ["seed", "integer", "str"]),
    ("step -5", lambda f, x: f(x, step=-5), "ValueError", ["step", "-5", "[0, 2**32)"]),
    ("step 2**32", lambda f, x: f(x, step=2**32), "ValueError", ["step", "[0, 2**32)"]),
    ("step 2**40", lambda f, x: f(x, step=2**40), "ValueError", ["step", str(2**40), "[0, 2**32)"]),
    ("step 3.0", lambda f, x: f(x, step=3.0), "TypeError", ["step", "integer", "float"]),
    # taken by truth value: "no" as True, a list (tensor_parallel's kind of stats) as a flag
    ("stats 'no'", lambda f, x: f(x, stats="no"), "TypeError", ["stats", "True or False", "str"]),
    ("stats []", lambda f, x: f(x, stats=[]), "TypeError", ["stats", "True or False", "list"]),
]  # fmt: skip
# the same for the collectives that take error_feedback
_ERROR_FEEDBACK = [
    ("error_feedback True", lambda f, x: f(x, error_feedback=True), "TypeError",
     ["error_feedback", "str", "bool"]),
    ("error_feedback 3", lambda f, x: f(x, error_feedback=3), "TypeError",
     ["error_feedback", "int"]),
]  # fmt: skip
# (case, call(comm, x, peer): peer is the other rank, exception type, words)
_ONE_OP = [
    ("all_gather total_dim0 -1", lambda c, x, peer: c.all_gather(x, total_dim0=-1), "ValueError",
     ["total_dim0", "-1"]),
    ("all_gather total_dim0 '8'", lambda c, x, peer: c.all_gather(x, total_dim0="8"), "TypeError",
     ["total_dim0", "str"]),
    ("all_gather total_dim0 8.0", lambda c, x, peer: c.all_gather(x, total_dim0=8.0), "TypeError",
     ["total_dim0", "float"]),
    ("send to itself", lambda c, x, peer: c.send(x, dst=c.rank), "ValueError",
     ["dst", "not another rank"]),
    ("send to rank 2", lambda c, x, peer: c.send(x, dst=2), "ValueError",
     ["dst", "2", "not another rank of 0..1"]),
    ("send to rank -1", lambda c, x, peer: c.send(x, dst=-1), "ValueError", ["dst", "-1"]),
    ("send to 1.0", lambda c, x, peer: c.send(x, dst=1.0), "TypeError", ["dst", "float"]),
    ("send float64", lambda c, x, peer: c.send(x.double(), dst=peer), "TypeError", ["float64"]),
    ("send seed -1", lambda c, x, peer: c.send(x, dst=peer, seed=-1), "ValueError", ["seed"]),
    ("send step 2**32", lambda c, x, peer: c.send(x, dst=peer, step=2**32), "ValueError",
     ["step"]),
    ("send rounding up", lambda c, x, peer: c.send(x, dst=peer, rounding="up"), "ValueError",
     ["rounding"]),
    ("recv from itself", lambda c, x, peer: c.recv((4, 32), torch.float32, src=c.rank),
     "ValueError", ["src", "not another rank"]),
    ("recv from 1.0", lambda c, x, peer: c.recv((4, 32), torch.float32, src=1.0), "TypeError",
     ["src", "float"]),
    ("recv shape -1", lambda c, x, peer: c.recv((-1, 32), torch.float32, src=peer), "ValueError",
     ["shape", "negative"]),
    ("recv shape 0-d", lambda c, x, peer: c.recv((), torch.float32, src=peer), "ValueError",
     ["shape", "0-d"]),
    ("recv shape 4.5", lambda c, x, peer: c.recv((4.5, 32), torch.float32, src=peer),
     "TypeError", ["shape", "float"]),
    ("recv shape 7", lambda c, x, peer: c.recv(7, torch.float32, src=peer), "TypeError",
     ["shape", "int"]),
    ("recv float64", lambda c, x, peer: c.recv((4, 32), torch.float64, src=peer), "TypeError",
     ["dtype", "float64"]),
    ("recv 'float64'", lambda c, x, peer: c.recv((4, 32), "float64", src=peer), "TypeError",
     ["dtype", "float64"]),
    ("recv 'nonsense'", lambda c, x, peer: c.recv((4, 32), "nonsense", src=peer), "TypeError",
     ["dtype", "nonsense"]),
    ("recv int8", lambda c, x, peer: c.recv((4, 32), np.int8, src=peer), "TypeError",
     ["dtype", "int8"]),
    ("recv codec fp5", lambda c, x, peer: c.recv((4, 32), torch.float32, src=peer, codec="fp5"),
     "ValueError", ["codec", "'fp5'"]),
    ("recv codec none-fp16",
     lambda c, x, peer: c.recv((4, 32), torch.float32, src=peer, codec="none-fp16"),
     "ValueError", ["codec", "'none-fp16'", "'none-float16'"]),
    ("synchronize timeout 1e-9", lambda c, x, peer: c.synchronize(1e-9), "ValueError",
     ["timeout_s", "below 1 ms"]),
    ("synchronize timeout '1'", lambda c, x, peer: c.synchronize("1"), "TypeError",
     ["timeout_s", "str"]),
    ("recv like str", lambda c, x, peer: c.recv((4, 32), torch.float32, src=peer, like="x"),
     "TypeError", ["torch tensor or a CuPy array", "str"]),
    ("capture a CPU tensor", lambda c, x, peer: c.capture("all_reduce", x), "ValueError",
     ["capture", "CUDA tensor"]),
    ("capture send", lambda c, x, peer: c.capture("send", x), "ValueError",
     ["capture", "'send'"]),
    ("load_state_dict []", lambda c, x, peer: c.load_state_dict([]), "ValueError",
     ["'calls'", "list"]),
    ("load_state_dict calls -1", lambda c, x, peer: c.load_state_dict(
        {"calls": -1, "sends": 0, "error_feedback": ErrorFeedback().state_dict()}),
     "ValueError", ["calls", "-1"]),
]  # fmt: skip


def _bad_collective_calls():
    """(case, call(comm, x, peer), exception type, words its message must hold) for bad
    arguments that every rank passes alike."""
    cases = []
    for ops, table in (
        (("all_reduce", "reduce_scatter", "all_gather"), _EVERY_COLLECTIVE),
        (("all_reduce", "reduce_scatter"), _ERROR_FEEDBACK),
    ):
        for op, (case, call, kind, words) in itertools.product(ops, table):
            cases.append((
                f"{op} {case}",
                lambda c, x, peer, op=op, call=call: call(getattr(c, op), x),
                kind,
                words,
            ))  # fmt: skip
    return cases + _ONE_OP


def _run_bad_collective_calls(comms):
    comm = comms[2]
    if comm is None:
        return None
    x = torch.ones(4, 32)
    out = {}
    for case, call, _, _ in _bad_collective_calls():
        try:
            call(comm, x, 1 - comm.rank)
            out[case] = ("returned", "")
        except Exception as err:  # noqa: BLE001 - the test judges what came out
            out[case] = (type(err).__name__, str(err))
    # and the group is still in step and usable
    out["afterwards"] = ("ok", comm.all_reduce(torch.ones(64), codec="none-float32")[0].item())
    return out


# case: (exception type, words its message must hold)
EXPECTED = {case: (kind, words) for case, _, kind, words in _bad_collective_calls()}
EXPECTED["afterwards"] = ("ok", [])


@pytest.fixture(scope="module")
def bad_call_outcomes(cluster):
    return cluster.run(_run_bad_collective_calls)[:2]


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_arguments_raise_a_clear_error_on_every_rank(bad_call_outcomes, case):
    kind, words = EXPECTED[case]
    for rank, out in enumerate(bad_call_outcomes):
        got, message = out[case]
        assert got == kind, (rank, case, got, message)
        for w in words:
            assert w in message, (rank, case, w, message)
    if case == "afterwards":
        assert all(out[case][1] == 2.0 for out in bad_call_outcomes)


def test_every_bad_call_case_has_an_expectation(bad_call_outcomes):
    for out in bad_call_outcomes:
        assert set(out) == set(EXPECTED)


def _nested():
    return torch.nested.nested_tensor([torch.ones(2, 32), torch.ones(3, 32)], layout=torch.jagged)


# ------------------------------------------------------------------ policies, every rank

SHAPES = [(5, 70), (3, 2, 33), (1,)]


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).tolist()


def _same_bits_in_each_collective(comm, x, plain, codec):
    """Whether all_reduce, reduce_scatter and all_gather of ``x`` give the bits they give
    for ``plain``."""
    ops = (comm.all_reduce, comm.reduce_scatter, comm.all_gather)
    return [_bits(op(x, codec=codec)) == _bits(op(plain, codec=codec)) for op in ops]


def _run_non_contiguous(comms, codec):
    """Each collective of a non-contiguous view equals that of its contiguous copy, bit for
    bit (the policy: non-contiguous input is accepted as its values)."""
    comm = comms[2]
    if comm is None:
        return None
    g = torch.Generator().manual_seed(comm.rank)
    base = torch.randn(40, 66, generator=g)
    wide = torch.randn(40, 128, generator=g)
    # wide[:, ::2] flattens to a strided view of whole blocks: no padding copy happens
    views = [base.t(), base[:, ::2], base[::3, 1:], wide[:, ::2]]
    same = []
    for v in views:
        assert not v.is_contiguous()
        same += _same_bits_in_each_collective(comm, v, v.contiguous(), codec)
    return same


def _run_negative_view(comms, codec):
    """Each collective of a negative view (torch._neg_view, a lazy negation) equals that of the
    negated tensor, bit for bit (the policy: such a view is taken as the values it stands
    for), and so does a send / recv of it."""
    comm = comms[2]
    if comm is None:
        return None
    x = torch.randn(8, 66, generator=torch.Generator().manual_seed(comm.rank))
    view, plain = torch._neg_view(x), -x
    assert view.is_neg()
    same = _same_bits_in_each_collective(comm, view, plain, codec)
    if comm.rank == 0:
        comm.send(view, dst=1, codec=codec)
        comm.send(plain, dst=1, codec=codec)
    else:
        got = [comm.recv((8, 66), torch.float32, src=0, codec=codec) for _ in range(2)]
        same.append(_bits(got[0]) == _bits(got[1]))
    return same


@pytest.mark.parametrize("codec", CODECS, ids=str)
@pytest.mark.parametrize(
    "run", [_run_non_contiguous, _run_negative_view], ids=["non-contiguous", "negative-view"]
)
def test_views_give_the_bits_of_the_tensor_they_stand_for(cluster, run, codec):
    for same in cluster.run(run, codec)[:2]:
        assert all(same), same


def _run_empty(comms, codec):
    comm = comms[2]
    if comm is None:
        return None
    out = []
    for shape in [(0,), (0, 32), (6, 0), (2, 0, 5)]:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.ones(shape, dtype=dtype)
            rs_rows = shard_rows(shape[0], 2)[comm.rank]
            results = {
                "all_reduce": (comm.all_reduce(x, codec=codec), shape),
                "reduce_scatter": (comm.reduce_scatter(x, codec=codec), (rs_rows, *shape[1:])),
                "all_gather": (comm.all_gather(x, codec=codec), (2 * shape[0], *shape[1:])),
            }
            if comm.rank == 0:
                comm.send(x, dst=1, codec=codec)
            else:
                results["recv"] = (comm.recv(shape, dtype, src=0, codec=codec), shape)
            for op, (y, want) in results.items():
                out.append((op, shape, str(dtype), tuple(y.shape), want, y.dtype == dtype))
    return out


@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_empty_tensors_give_empty_results_of_the_right_shape(cluster, codec):
    for out in cluster.run(_run_empty, codec)[:2]:
        for op, shape, dtype, got, want, same_dtype in out:
            assert got == tuple(want) and same_dtype, (op, shape, dtype, got, want)


def _run_non_finite(comms, codec):
    """Rank 0 puts +Inf at element 5 and NaN at 300, rank 1 -Inf at element 130, of a
    (8, 64) tensor; the results of all_reduce and all_gather."""
    comm = comms[2]
    if comm is None:
        return None
    g = torch.Generator().manual_seed(10 + comm.rank)
    x = torch.randn(8, 64, generator=g)
    flat = x.view(-1)
    if comm.rank == 0:
        flat[5], flat[300] = float("inf"), float("nan")
    else:
        flat[130] = float("-inf")
    return comm.all_reduce(x, codec=codec), comm.all_gather(x, codec=codec)


@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_non_finite_input_makes_its_block_nan_and_nothing_else(cluster, codec):
    (ar0, ag0), (ar1, ag1) = cluster.run(_run_non_finite, codec)[:2]
    assert _bits(ar0) == _bits(ar1) and _bits(ag0) == _bits(ag1)  # the same on every rank
    block = codecs.get_codec(codec).granularity
    n = 8 * 64
    if block == 1:
        # plain values: IEEE arithmetic on the values (inf + finite = inf, NaN stays NaN)
        want_ar = torch.zeros(n)
        want_ar[5], want_ar[300], want_ar[130] = float("inf"), float("nan"), float("-inf")
        got = ar0.reshape(-1)
        assert torch.equal(torch.isnan(got), torch.isnan(want_ar))
        assert torch.equal(torch.isposinf(got), torch.isposinf(want_ar))
        assert torch.equal(torch.isneginf(got), torch.isneginf(want_ar))
        return
    # FP4 codecs: the codec block that held a non-finite value decodes to NaN (all of it),
    # on every rank; every other element is finite.  The all-reduce's blocks are runs of
    # `block` elements of the flattened tensor (its chunks are whole blocks).
    bad_ar = torch.zeros(n // block, dtype=torch.bool)
    for i in (5, 300, 130):
        bad_ar[i // block] = True
    want = bad_ar.repeat_interleave(block)
    assert torch.equal(torch.isnan(ar0.reshape(-1)), want)
    assert torch.isfinite(ar0.reshape(-1)[~want]).all()
    bad_ag = torch.zeros(2 * n // block, dtype=torch.bool)
    for i in (5, 300, n + 130):  # all_gather: rank 1's rows follow rank 0's
        bad_ag[i // block] = True
    want = bad_ag.repeat_interleave(block)
    assert torch.equal(torch.isnan(ag0.reshape(-1)), want)
    assert torch.isfinite(ag0.reshape(-1)[~want]).all()


# ------------------------------------------------------------------ no process group needed


@pytest.mark.parametrize(
    ("call", "kind", "words"),
    [
        (lambda: shard_rows(-1, 2), ValueError, ["dim0", "-1"]),
        (lambda: shard_rows(4, 0), ValueError, ["world_size", "0"]),
        (lambda: shard_rows(4.0, 2), TypeError, ["dim0", "float"]),
        (lambda: shard_rows(4, "2"), TypeError, ["world_size", "str"]),
        (lambda: shard_rows(True, 2), TypeError, ["dim0", "bool"]),
        (lambda: shard_rows(4, True), TypeError, ["world_size", "bool"]),
        (lambda: shard_rows(4, 2**40), ValueError, ["world_size", "2**24"]),
        (lambda: ErrorFeedback().load_state_dict(
            {"residuals": {"a": {"worker": torch.ones(16).to_sparse()}}, "nonfinite_blocks": {}}),
         TypeError, ["residuals['a']['worker']", "sparse_coo"]),
        (lambda: ErrorFeedback().load_state_dict(
            {"residuals": {"a": {"worker": torch.ones(16, device="meta")}},
             "nonfinite_blocks": {}}),
         TypeError, ["residuals['a']['worker']", "meta"]),
        (lambda: ErrorFeedback().load_state_dict(
            {"residuals": {"a": {"worker": torch.ones(16)}},
             "nonfinite_blocks": {"a": {"worker": 2**70}}}),
         TypeError, ["nonfinite_blocks['a']['worker']", "[0, 2**63)"]),
        (lambda: codecs.get_codec("fp5"), ValueError, ["codec", "'fp5'"]),
        (lambda: codecs.get_codec(16), ValueError, ["codec"]),
        (lambda: codecs.get_codec("none-fp16"), ValueError,
         ["codec: 'none-fp16'", "'none-bfloat16', 'none-float32', 'none-float16'"]),
        (lambda: codecs.get_codec("none-float64"), ValueError, ["codec: 'none-float64'"]),
        (lambda: codecs.get_codec("bfloat16"), ValueError, ["codec: 'bfloat16'"]),
        (lambda: codecs.NoneCodec("fp16"), ValueError, ["NoneCodec: dtype 'fp16'"]),
        (lambda: codecs.NoneCodec("Tensor"), ValueError, ["NoneCodec: dtype 'Tensor'"]),
        (lambda: NcclTransport(None, "cuda:0", timeout_s=1e-9), ValueError,
         ["timeout_s", "below 1 ms"]),
        (lambda: NcclTransport(None, "cuda:0", timeout_s=float("nan")), ValueError,
         ["timeout_s"]),
        (lambda: codecs.NoneCodec("int8"), ValueError, ["int8"]),
        (lambda: codecs.NoneCodec(torch.float64), ValueError, ["float64"]),
        (lambda: codecs.FP4QuantCodec(group_size=3), ValueError, ["group_size", "3"]),
        (lambda: codecs.FP4QuantCodec(group_size=16.0), TypeError, ["group_size"]),
        (lambda: ErrorFeedback().load_state_dict({"residuals": {}}), ValueError,
         ["'residuals' and 'nonfinite_blocks'"]),
        (lambda: fp4_comm.Communicator(None, validate="sometimes"), ValueError,
         ["validate", "'sometimes'"]),
    ],
)  # fmt: skip
def test_functions_without_a_group_reject_bad_arguments(call, kind, words):
    with pytest.raises(kind) as info:
        call()
    for w in words:
        assert w in str(info.value)


def _codec_calls(codec):
    c = codecs.get_codec(codec)
    g = c.granularity if c.granularity > 1 else 16
    good = torch.ones(2, 2 * g)
    sections = c.encode(good)
    return [
        ("encode float64", lambda: c.encode(good.double()), TypeError, ["float64"]),
        ("encode int32", lambda: c.encode(good.int()), TypeError, ["int32"]),
        ("encode numpy", lambda: c.encode(good.numpy()), TypeError, ["torch tensor"]),
        ("encode 1-d", lambda: c.encode(torch.ones(2 * g)), ValueError, ["(chunks, n)"]),
        ("encode 3-d", lambda: c.encode(torch.ones(1, 2, 2 * g)), ValueError, ["(chunks, n)"]),
        ("encode non-contiguous", lambda: c.encode(torch.ones(4 * g, 2).t()), ValueError,
         ["contiguous"]),
        ("encode rounding up", lambda: c.encode(good, "up"), ValueError, ["rounding"]),
        ("encode meta", lambda: c.encode(good.to("meta")), TypeError, ["a meta tensor"]),
        ("encode nested", lambda: c.encode(_nested()), TypeError, ["a nested tensor"]),
        ("encode sparse", lambda: c.encode(good.to_sparse()), TypeError, ["sparse_coo"]),
        ("encode negative view", lambda: c.encode(torch._neg_view(good)), TypeError,
         ["negative-view", ".resolve_neg()"]),
        ("encode seed -1", lambda: c.encode(good, "stochastic", -1), ValueError, ["seed"]),
        ("encode step 2**32", lambda: c.encode(good, "stochastic", 0, 2**32), ValueError,
         ["step"]),
        ("section_nbytes -1", lambda: c.section_nbytes(-1), ValueError, ["n", "-1"]),
        ("section_nbytes 1.5", lambda: c.section_nbytes(1.5), TypeError, ["n", "float"]),
        ("decode no list", lambda: c.decode(sections[0], 2 * g), ValueError, ["sections"]),
        ("decode one too few", lambda: c.decode(sections[:-1] + [], 2 * g) if len(sections) > 1
         else c.decode([], 2 * g), ValueError, ["sections"]),
        ("decode float sections", lambda: c.decode([s.float() for s in sections], 2 * g),
         TypeError, ["uint8"]),
        ("decode wrong n", lambda: c.decode(sections, 4 * g), ValueError, ["shape"]),
        ("decode float64", lambda: c.decode(sections, 2 * g, torch.float64), TypeError,
         ["dtype"]),
    ] + ([  # sections that disagree on the number of chunks
        ("decode ragged chunks", lambda: c.decode([s[: 1 + i % 2] for i, s in
                                                    enumerate(sections)], 2 * g),
         ValueError, ["shape"]),
    ] if len(sections) > 1 else [])  # fmt: skip


@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_codec_methods_reject_bad_arguments(codec):
    for case, call, kind, words in _codec_calls(codec):
        with pytest.raises(kind) as info:
            call()
            pytest.fail(f"{case}: no {kind.__name__}")
        for w in words:
            assert w in str(info.value), (case, str(info.value))


@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_codecs_encode_and_decode_empty_payloads(codec):
    c = codecs.get_codec(codec)
    g = c.granularity
    for chunks, n in [(0, 2 * g), (3, 0)]:
        for dtype in (torch.float32, torch.bfloat16):
            sections = c.encode(torch.ones(chunks, n, dtype=dtype))
            assert [tuple(s.shape) for s in sections] == [(chunks, b) for b in c.section_nbytes(n)]
            y = c.decode(sections, n, dtype)
            assert tuple(y.shape) == (chunks, n) and y.dtype == dtype


def test_ddp_register_checks_its_options_before_the_first_backward():
    class _NotDDP:
        def register_comm_hook(self, state, hook):
            raise AssertionError("not reached")

    comm = fp4_comm.Communicator.__new__(fp4_comm.Communicator)  # no group needed to check
    for kwargs, kind, words in [
        ({"codec": "fp5"}, ValueError, ["codec"]),
        ({"codec": "none-fp16"}, ValueError, ["codec", "'none-fp16'", "'none-float16'"]),
        ({"rounding": "up"}, ValueError, ["rounding"]),
        ({"seed": -1}, ValueError, ["seed"]),
        ({"seed": 0.5}, TypeError, ["seed"]),
        ({"error_feedback": "yes"}, TypeError, ["error_feedback"]),
    ]:
        with pytest.raises(kind) as info:
            ddp.register(_NotDDP(), comm, **kwargs)
        assert all(w in str(info.value) for w in words), str(info.value)
    with pytest.raises(TypeError, match="comm: expected an fp4_comm.Communicator"):
        ddp.register(_NotDDP(), object())


#: Communicator.from_process_group's arguments (with device="cpu") that it refuses
BAD_CONSTRUCTION = [
    {"timeout_s": 0},
    {"timeout_s": -1.0},
    {"timeout_s": float("nan")},
    {"timeout_s": float("inf")},
    {"timeout_s": "60"},
    {"timeout_s": 1e-9},
    {"timeout_s": 5e-4},
    {"timeout_s": 1e20},
    {"validate": "sometimes"},
    {"device": "meta"},
]


def test_communicator_construction_rejects_bad_arguments(cluster):
    expected = [
        ("ValueError", "timeout_s"),
        ("ValueError", "timeout_s"),
        ("ValueError", "timeout_s"),
        ("ValueError", "timeout_s"),
        ("TypeError", "timeout_s"),
        ("ValueError", "timeout_s: 1e-09 s is below 1 ms"),
        ("ValueError", "timeout_s: 0.0005 s is below 1 ms"),
        ("ValueError", "timeout_s: 1e+20 s is beyond"),
        ("ValueError", "validate"),
        ("ValueError", "neither a CUDA device nor the CPU"),
    ]
    cases = [{"device": "cpu", **kwargs} for kwargs in BAD_CONSTRUCTION]
    for out in cluster.run(construction_outcomes, cases)[:2]:
        for (kind, message), (want_kind, word) in zip(out, expected, strict=True):
            assert kind == want_kind and word in message, (kind, message)
