"""fp4_comm.reference: k ranks in one process, equal bit for bit to the k-process run.

Every collective (all_reduce, reduce_scatter, all_gather with equal and with shard_rows
shards, send/recv) with every codec (bf16 and float32 values, NVFP4, MXFP4 including its fused
requantized sum, FP4Quant at g = 16, 64 and 256, with and without the transform), nearest and
stochastic rounding, with and without error feedback (two calls, so that the residual of the
first one is in the second), float32 and bfloat16 inputs of ragged sizes: the gloo run on 2, 3
and 4 processes against ``reference`` in this process, every rank's result and statistics.
Then what the emulation adds: ``EmulatedRanks``' per-rank call counts and residuals, the
argument checks, and a rank that fails stopping the others instead of hanging them.  Marked
``gpu``: the same against NCCL with 2 or 4 ranks on one GPU (multi-rank mode).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

import fp4_comm
import fp4_comm._transport
import fp4_kernels
from fp4_comm import CommTimeoutError, ErrorFeedback, reference
from fp4_comm.collectives import shard_rows

SEED, STEP = 11, 5
CODECS = ["none", "none-float32", "nvfp4", "mxfp4", "fp4quant-g64", "fp4quant-g16-nohad",
          "fp4quant-g256"]  # fmt: skip
ROUNDINGS = ["nearest", "stochastic"]


def _codec(spec):
    """A codec as the collectives take it (FP4Quant as an fp4_kernels.FP4Quant)."""
    if spec.startswith("fp4quant-g"):
        g, *rest = spec[len("fp4quant-g") :].split("-")
        return fp4_kernels.FP4Quant(int(g), hadamard=rest != ["nohad"])
    return spec


def _cases():
    """(op, codec, rounding, error_feedback, dtype name, shape, total_dim0)."""
    cases = []
    for codec in CODECS:
        for rounding in ROUNDINGS:
            dtype = "bfloat16" if rounding == "stochastic" else "float32"
            for ef in (False, True):
                cases.append(("all_reduce", codec, rounding, ef, dtype, (37, 40), None))
                cases.append(("all_reduce_one_shot", codec, rounding, ef, dtype, (37, 40), None))
                cases.append(("reduce_scatter", codec, rounding, ef, dtype, (13, 24), None))
            cases.append(("all_gather", codec, rounding, False, dtype, (3, 40), None))
            cases.append(("all_gather", codec, rounding, False, dtype, (None, 24), 7))
            cases.append(("send", codec, rounding, False, dtype, (5, 33), None))
    return cases


CASES = _cases()


def _input(case_index, call, rank, world, case):
    _, _, _, _, dtype, shape, total = case
    if total is not None:
        shape = (shard_rows(total, world)[rank], *shape[1:])
    g = torch.Generator().manual_seed(1000 * case_index + 100 * call + rank)
    x = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-3, 4, shape, generator=g)
    return x.to(getattr(torch, dtype))


def _bits(t):
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()


def _stats(hops):
    return {hop: s.as_floats() for hop, s in sorted(hops.items())}


def _calls(case):
    return 2 if case[3] else 1  # error feedback: a second call that uses the first residual


def _run_cases(comms, world, cases, device="cpu"):
    """Every case on this rank of ``comms[world]`` (or the NCCL communicator); the one-shot
    all-reduce cases on a communicator over the same transport that asks for it."""
    comm = comms[world] if device == "cpu" else comms["cuda"]
    if comm is None:
        return None
    r = comm.rank
    import fp4_comm

    one_shot = fp4_comm.Communicator(comm.transport, comm.control_group, comm.validate,
                                     all_reduce_algorithm="one_shot")  # fmt: skip
    out = []
    for i, case in enumerate(cases):
        op, codec, rounding, ef, *_ = case
        if op == "all_reduce_one_shot":
            comm, op = one_shot, "all_reduce"
        else:
            comm = comms[world] if device == "cpu" else comms["cuda"]
        kw = {"codec": _codec(codec), "rounding": rounding, "seed": SEED}
        results = []
        for call in range(_calls(case)):
            x = _input(i, call, r, world, case).to(comm.device)
            step = STEP + call
            if op == "send":
                if r == 0:
                    hops = comm.send(x, world - 1, **kw, step=step, stats=True)[1]
                    results.append((None, _stats(hops)))
                elif r == world - 1:
                    y = comm.recv(tuple(x.shape), x.dtype, 0, codec=kw["codec"])
                    results.append((_bits(y), None))
                continue
            extra = {}
            if op in ("all_reduce", "reduce_scatter") and ef:
                extra["error_feedback"] = f"case{i}"
            if op == "all_gather" and case[6] is not None:
                extra["total_dim0"] = case[6]
            # statistics with error feedback only: they turn off MXFP4's fused sum
            y = getattr(comm, op)(x, **kw, step=step, stats=ef, **extra)
            if ef:
                y, hops = y
                results.append((_bits(y), _stats(hops)))
            else:
                results.append((_bits(y), None))
        out.append(results)
    for c in (one_shot, comms[world] if device == "cpu" else comms["cuda"]):
        c.error_feedback.reset()
    return out


def _reference_cases(world, cases, device="cpu"):
    """The same cases through ``reference``: every rank's results, by rank."""
    out = [[] for _ in range(world)]
    for i, case in enumerate(cases):
        op, codec, rounding, ef, *_ = case
        kw = {"codec": _codec(codec), "rounding": rounding, "seed": SEED}
        residuals = [ErrorFeedback() for _ in range(world)]
        per_rank = [[] for _ in range(world)]
        for call in range(_calls(case)):
            xs = [_input(i, call, r, world, case).to(device) for r in range(world)]
            step = STEP + call
            if op == "send":
                y, hops = reference.send_recv(xs[0], 0, world - 1, world, **kw, step=step,
                                              stats=True)  # fmt: skip
                per_rank[0].append((None, _stats(hops)))
                per_rank[world - 1].append((_bits(y), None))
                continue
            fn, extra = op, {}
            if op == "all_reduce_one_shot":
                fn, extra = "all_reduce", {"algorithm": "one_shot"}
            if fn in ("all_reduce", "reduce_scatter") and ef:
                extra.update(error_feedback="x", residuals=residuals)
            if op == "all_gather" and case[6] is not None:
                extra["total_dim0"] = case[6]
            ys = getattr(reference, fn)(xs, **kw, step=step, stats=ef, **extra)
            if ef:
                ys, hops = ys
                for r in range(world):
                    per_rank[r].append((_bits(ys[r]), _stats(hops[r])))
            else:
                for r in range(world):
                    per_rank[r].append((_bits(ys[r]), None))
        for r in range(world):
            out[r].append(per_rank[r])
    return out


def _assert_same(real, emulated, cases):
    for r, (mine, ref) in enumerate(zip(real, emulated, strict=True)):
        for case, a, b in zip(cases, mine, ref, strict=True):
            assert len(a) == len(b), (r, case)
            for call, ((bits_a, stats_a), (bits_b, stats_b)) in enumerate(zip(a, b, strict=True)):
                where = f"rank {r}, call {call}, {case}"
                if bits_a is None:
                    assert bits_b is None, where
                else:
                    assert bits_a.shape == bits_b.shape and np.array_equal(bits_a, bits_b), where
                np.testing.assert_equal(stats_a, stats_b, err_msg=where)  # NaN == NaN here


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective_equals_the_gloo_run(cluster, world):
    real = cluster.run(_run_cases, world, CASES)[:world]
    _assert_same(real, _reference_cases(world, CASES), CASES)


def test_the_cases_reach_every_path():
    """The cases are what the docstring says: every op x codec x rounding, error feedback
    on the sums, uneven all_gather shards."""
    ops = {(c[0], c[1], c[2], c[3]) for c in CASES}
    for codec in CODECS:
        for rounding in ROUNDINGS:
            for op in ("all_reduce", "all_reduce_one_shot", "reduce_scatter"):
                assert {(op, codec, rounding, ef) for ef in (False, True)} <= ops
            assert ("send", codec, rounding, False) in ops
    assert any(c[0] == "all_gather" and c[6] for c in CASES)
    # the fused MXFP4 sum: nearest, no error feedback, no statistics
    assert ("all_reduce", "mxfp4", "nearest", False) in ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec", CODECS)
def test_one_shot_all_reduce_is_one_encode_per_rank_summed_in_rank_order(codec, dtype):
    """The one-shot all-reduce against its definition written out with the codec: each rank
    encodes its whole (zero-padded) input with its "reduce_scatter" key, every rank decodes
    the W payloads and adds them in float32 in rank order, one rounding to the dtype.  And it
    is not the two-shot result (which encodes the sum again) where the codec loses bits."""
    from fp4_comm.codecs import get_codec, padded_chunk
    from fp4_comm.collectives import rank_seed

    world, n = 3, 37 * 40
    c = get_codec(_codec(codec))
    xs = [_input(7, 0, r, world, CASES[0]).to(dtype) for r in range(world)]
    got = reference.all_reduce(xs, codec=_codec(codec), rounding="stochastic", seed=SEED,
                               step=STEP, algorithm="one_shot")  # fmt: skip
    width = padded_chunk(n, 1, c.granularity)
    acc = None
    for r, x in enumerate(xs):
        payload = torch.zeros(1, width, dtype=dtype)
        payload[0, :n] = x.reshape(-1)
        enc = c.encode(payload, "stochastic", rank_seed(SEED, r, "reduce_scatter"), STEP)
        d = c.decode(enc, width, torch.float32)[0, :n]
        acc = d.clone() if acc is None else acc + d
    want = acc.to(dtype).view(xs[0].shape)
    for y in got:
        assert torch.equal(_as_bits(y), _as_bits(want))
    two_shot = reference.all_reduce(xs, codec=_codec(codec), rounding="stochastic", seed=SEED,
                                    step=STEP, algorithm="two_shot")  # fmt: skip
    lossless = codec == "none-float32" or (codec == "none" and dtype == torch.bfloat16)
    assert torch.equal(_as_bits(two_shot[0]), _as_bits(want)) == lossless


def _as_bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize(("transport", "world", "nbytes", "want"), [
    ("p2p", 2, 512 << 10, "one_shot"),
    ("p2p", 4, 512 << 10, "one_shot"),
    ("p2p", 4, (512 << 10) + 2, "two_shot"),
    ("p2p", 5, 1024, "two_shot"),
    ("nccl", 2, 1024, "two_shot"),
    ("gloo", 2, 1024, "two_shot"),
])  # fmt: skip
def test_auto_takes_one_shot_for_small_messages_on_few_p2p_ranks(transport, world, nbytes, want):
    from fp4_comm import collectives

    xs = [torch.ones(nbytes // 2, dtype=torch.bfloat16) for _ in range(world)]
    # the input (not its padding) decides; "auto" follows the named transport
    auto = reference.all_reduce(xs, codec="nvfp4", algorithm="auto", transport=transport)
    chosen = reference.all_reduce(xs, codec="nvfp4", algorithm=want)
    other = "two_shot" if want == "one_shot" else "one_shot"
    assert collectives.resolve_all_reduce_algorithm("auto", transport == "p2p", world,
                                                    nbytes) == want  # fmt: skip
    assert collectives.resolve_all_reduce_algorithm(other, transport == "p2p", world,
                                                    nbytes) == other  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(auto, chosen, strict=True))


def test_emulated_ranks_take_the_algorithm_and_equal_the_reference():
    xs = [_input(3, 0, r, 2, CASES[0]).to(torch.bfloat16) for r in range(2)]
    for algorithm in ("one_shot", "two_shot"):
        ranks = reference.EmulatedRanks(2, all_reduce_algorithm=algorithm)
        got = ranks.all_reduce(xs, codec="nvfp4", rounding="stochastic", seed=SEED, step=STEP)
        want = reference.all_reduce(xs, codec="nvfp4", rounding="stochastic", seed=SEED,
                                    step=STEP, algorithm=algorithm)  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # "auto" on emulated p2p ranks: one-shot for this small message
    ranks = reference.EmulatedRanks(2, transport="p2p")
    got = ranks.all_reduce(xs, codec="nvfp4", step=0)
    want = reference.all_reduce(xs, codec="nvfp4", algorithm="one_shot")
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("call", [
    lambda: reference.EmulatedRanks(2, all_reduce_algorithm="three_shot"),
    lambda: reference.EmulatedRanks(2, transport="ucx"),
    lambda: reference.all_reduce([torch.ones(4)] * 2, algorithm="one-shot"),
    lambda: reference.all_reduce([torch.ones(4)] * 2, transport="mpi"),
    lambda: fp4_comm.Communicator(_StubTransport(), all_reduce_algorithm=None),
])  # fmt: skip
def test_a_bad_algorithm_or_transport_name_is_a_value_error_naming_it(call):
    with pytest.raises(ValueError, match="all_reduce_algorithm: |transport: "):
        call()


class _StubTransport(fp4_comm._transport.Transport):
    rank, world_size, device = 0, 1, torch.device("cpu")


# ------------------------------------------------------------------ the stateful group


def _run_defaults(comms, world):
    """Calls that leave step, residuals and send counts to the communicator."""
    comm = comms[world]
    if comm is None:
        return None
    r = comm.rank
    # counted from 0, as a new communicator (the emulated ranks') counts
    saved, comm._calls, comm._sends = (comm._calls, comm._sends), 0, 0
    out = []
    for i in range(3):
        x = _input(i, 0, r, world, CASES[0])
        y = comm.all_reduce(x, codec="nvfp4", rounding="stochastic", error_feedback="d")
        out.append(_bits(y))
        y = comm.reduce_scatter(x, codec=_codec("fp4quant-g64"), rounding="stochastic")
        out.append(_bits(y))
        if r == 0:
            comm.send(x, world - 1, codec="mxfp4", rounding="stochastic")
        elif r == world - 1:
            out.append(_bits(comm.recv(tuple(x.shape), x.dtype, 0, codec="mxfp4")))
    comm.error_feedback.reset()
    comm._calls, comm._sends = saved
    return out


def test_emulated_ranks_count_calls_and_keep_residuals_per_rank(cluster):
    """EmulatedRanks: the default step (each rank's call count, or count of sends) and each
    rank's error-feedback residuals, as the processes have them."""
    world = 3
    real = cluster.run(_run_defaults, world)[:world]
    ranks = reference.EmulatedRanks(world)
    emulated = [[] for _ in range(world)]
    for i in range(3):
        xs = [_input(i, 0, r, world, CASES[0]) for r in range(world)]
        ys = ranks.all_reduce(xs, codec="nvfp4", rounding="stochastic", error_feedback="d")
        zs = ranks.reduce_scatter(xs, codec=_codec("fp4quant-g64"), rounding="stochastic")
        for r in range(world):
            emulated[r] += [_bits(ys[r]), _bits(zs[r])]
        y = ranks.send_recv(xs[0], 0, world - 1, codec="mxfp4", rounding="stochastic")
        emulated[world - 1].append(_bits(y))
    for r in range(world):
        assert len(real[r]) == len(emulated[r])
        for a, b in zip(real[r], emulated[r], strict=True):
            assert np.array_equal(a, b), r
    assert [c._calls for c in ranks.comms] == [6] * world
    assert [c._sends for c in ranks.comms] == [3] + [0] * (world - 1)
    res = [c.error_feedback.residual("d") for c in ranks.comms]
    assert not torch.equal(res[0], res[1])  # each rank's own


# ---------------------------------------------------------------- group graphs (CPU stand-in)


class _FakeGroupGraph:
    """A stand-in "graph" of the group's call: a replay runs the call again on the ranks'
    threads into the outputs, with the ranks' call counts left as they were (a replay runs
    no host code)."""

    def __init__(self, ranks, run, statics, outputs):
        self.ranks, self.run, self.statics, self.outputs = ranks, run, statics, outputs
        self.replays = 0

    def replay(self):
        self.replays += 1
        counts = [c._calls for c in self.ranks.comms]
        for out, y in zip(self.outputs, self.run(self.statics), strict=True):
            out.copy_(y)
        for c, n in zip(self.ranks.comms, counts, strict=True):
            c._calls = n


def _fake_group_capture(ranks, graphs_made):
    """The stand-in capture: the template outputs from one run of the call, after which the
    ranks' error-feedback state is put back (in place: ``load_state_dict``), so that the
    replay that follows is the call's only update of the residuals, as on a GPU."""

    def capture(run, device, shapes, dtype):
        statics = [torch.zeros(s, dtype=dtype) for s in shapes]
        saved = [c.error_feedback.state_dict() for c in ranks.comms]
        outs = [y.clone() for y in run(statics)]
        for c, state in zip(ranks.comms, saved, strict=True):
            c.error_feedback.load_state_dict(state)
        graph = _FakeGroupGraph(ranks, run, statics, outs)
        graphs_made.append(graph)
        return graph, statics, outs

    return capture


class _Stream:
    def wait_stream(self, other):
        pass


def test_group_graphs_capture_the_third_eligible_call_and_replays_equal_eager(monkeypatch):
    """EmulatedRanks(graphs="auto"), with a stand-in capture on the CPU: the third call of an
    eligible kind is captured and later ones replay it, with the eager results (each input's
    own) and every rank's call count as the eager group has it; stochastic rounding, error
    feedback replay too (each rank's step written into the graph's step tensors, the
    residuals updated in place), statistics never; a failed capture leaves its kind eager."""
    from fp4_comm import graphs

    world = 3
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    graphed = reference.EmulatedRanks(world)
    graphed.graphs = "auto"  # on the CPU, for the stand-in (a CPU group refuses "auto")
    made = []
    monkeypatch.setattr(graphs, "capture_group", _fake_group_capture(graphed, made))
    eager = reference.EmulatedRanks(world)
    calls = [("all_reduce", {"codec": "nvfp4"}), ("reduce_scatter", {"codec": "mxfp4"}),
             ("all_gather", {"codec": _codec("fp4quant-g64")}),
             ("all_reduce", {"codec": "none"}),
             ("all_reduce", {"codec": "nvfp4", "rounding": "stochastic"}),
             ("all_reduce", {"codec": "nvfp4", "error_feedback": "b"}),
             ("reduce_scatter", {"codec": _codec("fp4quant-g64"), "rounding": "stochastic",
                                 "error_feedback": "c", "seed": 4}),
             ("reduce_scatter", {"codec": "nvfp4", "stats": True})]  # fmt: skip
    for i in range(5):
        for j, (op, kw) in enumerate(calls):
            xs = [_input(i + 10 * j, 0, r, world, CASES[0]) for r in range(world)]
            ys = getattr(graphed, op)(xs, **kw)
            refs = getattr(eager, op)(xs, **kw)
            if kw.get("stats"):
                ys, refs = [y for y, _ in ys], [y for y, _ in refs]
            for y, ref in zip(ys, refs, strict=True):
                assert np.array_equal(_bits(y), _bits(ref)), (i, op, kw)
    assert len(made) == 7  # the seven eligible kinds, each captured once (on its third call)
    assert [g.replays for g in made] == [3] * 7  # calls 3, 4, 5
    assert [c._calls for c in graphed.comms] == [c._calls for c in eager.comms] == [40] * world
    for c, e in zip(graphed.comms, eager.comms, strict=True):
        for name in ("b", "c"):
            assert torch.equal(c.error_feedback.residual(name), e.error_feedback.residual(name))

    def failing(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "capture_group", failing)
    xs = [torch.ones(6, 4) * (r + 1) for r in range(world)]
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        for _ in range(4):
            ys = graphed.all_reduce(xs, codec="none")
    assert all(torch.equal(y, torch.full((6, 4), 6.0)) for y in ys)
    with pytest.raises(ValueError, match="graphs='auto'.*cpu"):
        reference.EmulatedRanks(2, graphs="auto")


def test_group_graphs_bound_each_rank_input_as_its_communicator(monkeypatch):
    """A group call stands for one rank's input in the graph bounds, which bound each rank's
    communicator: with 8 ranks, inputs within ``GRAPH_MAX_BYTES`` each (though 8 times it
    together, as TP = 8's float32 gradient sums are) replay, and the cache counts one rank's
    bytes; a rank's input beyond the bound stays eager."""
    from fp4_comm import graphs

    world, small, large = 8, (16, 32), (32, 32)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(graphs, "GRAPH_MAX_BYTES", 16 * 32 * 4)  # one rank's small input
    ranks = reference.EmulatedRanks(world)
    ranks.graphs = "auto"  # on the CPU, for the stand-in
    made = []
    monkeypatch.setattr(graphs, "capture_group", _fake_group_capture(ranks, made))
    for shape in (small, large):
        for i in range(4):
            ys = ranks.all_reduce([torch.full(shape, float(r + i)) for r in range(world)],
                                  codec="none")  # fmt: skip
            total = float(sum(range(world)) + world * i)
            assert all(torch.equal(y, torch.full(shape, total)) for y in ys), (shape, i)
    assert len(made) == 1 and made[0].statics[0].shape == small
    assert made[0].replays == 2  # calls 3 and 4 of the small kind; the large one eager
    assert ranks._graphed._bytes == 16 * 32 * 4


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["none", "nvfp4"])
def test_gpu_group_graph_over_the_bound_together_replays_the_eager_bits(codec, monkeypatch):
    """On the GPU, 8 emulated ranks whose float32 inputs are within ``GRAPH_MAX_BYTES`` each
    but over it together (as TP = 8's gradient sums are) are captured in one group graph, and
    its replays give the eager group's bits."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from fp4_comm import graphs

    world, shape = 8, (256, 768)
    monkeypatch.setattr(graphs, "GRAPH_MAX_BYTES", shape[0] * shape[1] * 4)
    graphed = reference.EmulatedRanks(world, "cuda")
    eager = reference.EmulatedRanks(world, "cuda", graphs="never")
    gen = torch.Generator().manual_seed(5)
    for i in range(5):
        xs = [torch.randn(shape, generator=gen).cuda() for _ in range(world)]
        ys, refs = graphed.all_reduce(xs, codec=codec), eager.all_reduce(xs, codec=codec)
        for y, ref in zip(ys, refs, strict=True):
            assert torch.equal(y.view(torch.int32), ref.view(torch.int32)), i
    assert len(graphed._graphed) == 1  # captured at the third call, replayed since


def test_a_group_graph_keeps_the_plans_its_ranks_ran_alive(monkeypatch):
    """A group graph replays the ranks' calls on their communicators' plans, reading and
    writing the plans' buffers; a communicator drops plans beyond its cache's bound (each
    error-feedback name is a kind of call: more sites than PLAN_CACHE_SIZE), and a dropped
    plan's buffers would go back to the allocator while the graph still used them: the
    graph keeps them alive, as long as it lives."""
    import gc
    import weakref

    from fp4_comm import communicator, graphs

    monkeypatch.setattr(communicator, "PLAN_CACHE_SIZE", 2)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    ranks = reference.EmulatedRanks(2)
    ranks.graphs = "auto"  # on the CPU, for the stand-in
    monkeypatch.setattr(graphs, "capture_group", _fake_group_capture(ranks, []))
    xs = [torch.randn(4, 32) for _ in range(2)]
    for _ in range(3):  # two eager calls, then the capture
        ranks.all_reduce(xs, codec="nvfp4", error_feedback="site0")
    captured = [weakref.ref(next(reversed(c._plans.values())).plan) for c in ranks.comms]
    for i in range(1, 4):  # other sites: the communicators drop the captured kind's plan
        ranks.all_reduce(xs, codec="nvfp4", error_feedback=f"site{i}")
    gc.collect()
    for c, ref in zip(ranks.comms, captured, strict=True):
        assert ref() is not None and all(e.plan is not ref() for e in c._plans.values())
    ranks._graphed.clear()  # the graph goes: so do the plans it held
    gc.collect()
    assert all(ref() is None for ref in captured)


def test_group_graphs_of_another_seed_or_replaced_residuals_run_eagerly(monkeypatch):
    """A call of another seed than captured runs eagerly (the graph stays); a reset refills
    the residuals in place (the graph goes on replaying), but a payload of another shape
    under the name replaces them: the graph is dropped."""
    from fp4_comm import graphs

    world = 2
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    graphed, eager = reference.EmulatedRanks(world), reference.EmulatedRanks(world)
    graphed.graphs = "auto"  # on the CPU, for the stand-in
    made = []
    monkeypatch.setattr(graphs, "capture_group", _fake_group_capture(graphed, made))
    sr = {"codec": "nvfp4", "rounding": "stochastic", "error_feedback": "e", "seed": 1}
    plan = [(8, sr)] * 4 + [(8, dict(sr, seed=2)), "reset", (8, sr), "reset", (4, sr), "reset",
                            (8, sr), (8, sr)]  # fmt: skip
    for i, call in enumerate(plan):
        if call == "reset":
            for ranks in (graphed, eager):
                for c in ranks.comms:
                    c.error_feedback.reset("e")
            continue
        rows, kw = call
        xs = [torch.randn(rows, 64, generator=torch.Generator().manual_seed(10 * i + r))
              for r in range(world)]  # fmt: skip
        for y, ref in zip(graphed.all_reduce(xs, **kw), eager.all_reduce(xs, **kw), strict=True):
            assert np.array_equal(_bits(y), _bits(ref)), (i, kw)
        if i == 5:  # after the reset in place: replayed
            assert made[0].replays == 3
    # calls 3 and 4 and the one after the first reset replayed; seed 2 ran eagerly; the rows
    # of 4 replaced the residuals, and the later calls of 8 rows did not replay
    assert made[0].replays == 3
    for c, e in zip(graphed.comms, eager.comms, strict=True):
        assert torch.equal(c.error_feedback.residual("e"), e.error_feedback.residual("e"))


@pytest.mark.parametrize("bounds", [None, (10, 1 << 20)])
def test_group_graphs_of_more_error_feedback_sites_than_the_cache_holds(bounds, monkeypatch):
    """Ten error-feedback names called in turn (a model's sums, once a step): the default
    cache keeps the last eight captured, the two dropped run eagerly from then on; with
    ``graph_cache`` room for ten, every one replays.  Both give the eager bits."""
    from fp4_comm import graphs

    world, sites = 2, 10
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    graphed = reference.EmulatedRanks(world, graph_cache=bounds)
    eager = reference.EmulatedRanks(world)
    graphed.graphs = "auto"  # on the CPU, for the stand-in
    made = []
    monkeypatch.setattr(graphs, "capture_group", _fake_group_capture(graphed, made))
    for i in range(5):
        for j in range(sites):
            kw = {"codec": "nvfp4", "error_feedback": f"s{j}"}
            xs = [torch.randn(4, 64, generator=torch.Generator().manual_seed(100 * i + 10 * j + r))
                  for r in range(world)]  # fmt: skip
            for y, ref in zip(graphed.all_reduce(xs, **kw), eager.all_reduce(xs, **kw),
                              strict=True):  # fmt: skip
                assert np.array_equal(_bits(y), _bits(ref)), (i, j)
    kept = sites if bounds else graphs.GRAPH_CACHE_SIZE
    assert len(graphed._graphed) == kept and len(made) == sites
    # kept: replayed at calls 3, 4 and 5; dropped: at its capture only
    assert [g.replays for g in made] == [1] * (sites - kept) + [3] * kept


# ------------------------------------------------------------------ checks and failures


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: reference.all_reduce(torch.ones(4)), TypeError, "list of the ranks' tensors"),
        (lambda: reference.all_reduce([torch.ones(4), torch.ones(5)]), ValueError,
         r"rank 0 has shape \(4,\), rank 1 \(5,\)"),
        (lambda: reference.all_reduce([torch.ones(4), torch.ones(4, dtype=torch.bfloat16)]),
         ValueError, "ranks disagree"),
        (lambda: reference.all_reduce([torch.ones(4), torch.ones(4, dtype=torch.int32)]),
         TypeError, "rank 1's input: dtype torch.int32"),
        (lambda: reference.all_reduce([torch.ones(()), torch.ones(())]), ValueError, "0-d"),
        (lambda: reference.all_reduce([torch.ones(4)] * 2, codec="fp5"), ValueError, "codec"),
        (lambda: reference.all_reduce([torch.ones(4)] * 2, rounding="up"), ValueError,
         "rounding"),
        (lambda: reference.all_reduce([torch.ones(4)] * 2, seed=True), TypeError,
         "seed: expected an integer, got bool"),
        (lambda: reference.EmulatedRanks(True), TypeError,
         "world_size: expected an integer, got bool"),
        (lambda: reference.all_reduce([torch.ones(4)] * 2, error_feedback="e"), ValueError,
         "one ErrorFeedback per rank"),
        (lambda: reference.all_reduce([torch.ones(4)] * 2, residuals=[ErrorFeedback()] * 2),
         ValueError, "no error_feedback buffer name"),
        (lambda: reference.all_gather([torch.ones(2, 3), torch.ones(2, 3)], total_dim0=3),
         ValueError, r"rank 1 holds shape \(2, 3\).*1 rows"),
        (lambda: reference.send_recv(torch.ones(4), 0, 0), ValueError, "both 0"),
        (lambda: reference.send_recv(torch.ones(4), 0, 2, 2), ValueError, "dst = 2"),
        (lambda: reference.EmulatedRanks(0), ValueError, "world_size is 0"),
        # the ranks' threads shared one object's residuals (results changed from run to run)
        (lambda: reference.all_reduce([torch.ones(4, 64)] * 3, error_feedback="g",
                                      residuals=[ErrorFeedback()] * 3),
         ValueError, r"one ErrorFeedback object appears for several ranks"),
        # a tensor step was taken by int(): 3.7 ran as 3, -1 as 2**32 - 1
        (lambda: reference.all_reduce([torch.ones(4)] * 2, rounding="stochastic",
                                      step=torch.tensor(3.7)), TypeError,
         "step: expected an integer, got Tensor"),
        (lambda: reference.all_reduce([torch.ones(4)] * 2, step=torch.tensor(-1)), ValueError,
         r"step: -1 is outside \[0, 2\*\*32\)"),
        (lambda: reference.send_recv(torch.ones(4), step=None), TypeError,
         "step: expected an integer, got NoneType"),
        (lambda: reference.EmulatedRanks(2, timeout_s="1"), TypeError,
         "timeout_s: expected seconds as a number, got str"),
        (lambda: reference.EmulatedRanks(2, timeout_s=True), TypeError, "timeout_s"),
        (lambda: reference.EmulatedRanks(2, timeout_s=1e-4), ValueError, "below 1 ms"),
        (lambda: reference.EmulatedRanks(2, timeout_s=float("inf")), ValueError, "timeout_s"),
        (lambda: reference.EmulatedRanks(2, timeout_s=0), ValueError, "timeout_s"),
        # bound before either rank runs: the receiver is never left waiting for the timeout
        (lambda: reference.EmulatedRanks(2, timeout_s=600).send_recv(torch.ones(4), 0, 1,
                                                                     codec="mxfp4", bogus=1),
         TypeError, "send_recv: got an unexpected keyword argument 'bogus'"),
        (lambda: reference.EmulatedRanks(2, timeout_s=600).send_recv(torch.ones(4), 0, 1,
                                                                     "mxfp4"),
         TypeError, "send_recv.*positional"),
        (lambda: reference.EmulatedRanks(2).all_reduce([torch.ones(4)] * 3), ValueError,
         "one tensor per rank"),
    ],
)  # fmt: skip
def test_bad_arguments_name_what_is_wrong(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("stats", ["no", [], [0], 1, None], ids=repr)
def test_stats_must_be_true_or_false(stats):
    # stats is a flag here (True: also return the HopStats): a truthy string or a list was
    # taken as True and an empty list as False, where tensor_parallel's stats is a list that
    # the WireStats are appended to.
    xs = [torch.ones(4, 32)] * 2
    for name, call in _rank_calls():
        with pytest.raises(TypeError, match=r"stats: True or False") as info:
            call(xs, stats=stats)
        assert type(stats).__name__ in str(info.value), name


# (case, the k = 2 ranks' inputs, exception type, words its message must hold): what
# fp4_comm.reference's functions and EmulatedRanks refuse, naming the rank, as a Communicator
# refuses it on that rank
_RANK_INPUTS = [
    ("float64", lambda x: [x, x.double()], TypeError, ["rank 1's input", "float64",
                                                      "float32, bfloat16, float16"]),
    ("nested", lambda x: [_nested(), _nested()], TypeError,
     ["rank 0's input", "nested", "torch.nested.to_padded_tensor"]),
    ("sparse", lambda x: [x, x.to_sparse()], TypeError,
     ["rank 1's input", "torch.sparse_coo", ".to_dense()"]),
    ("meta", lambda x: [x.to("meta"), x.to("meta")], ValueError, ["rank 0's input", "meta"]),
    ("0-d", lambda x: [torch.ones(()), torch.ones(())], ValueError, ["rank 0's input", "0-d"]),
    ("numpy", lambda x: [x, x.numpy()], TypeError, ["rank 1's input", "ndarray"]),
    ("one tensor", lambda x: x, TypeError, ["a list of the ranks' tensors"]),
    ("dtypes differ", lambda x: [x, x.bfloat16()], ValueError, ["ranks disagree"]),
]  # fmt: skip


def _rank_calls():
    """(name, function of the ranks' inputs) for every function of the ranks of one process."""
    ranks = reference.EmulatedRanks(2)
    return [
        ("reference.all_reduce", reference.all_reduce),
        ("reference.reduce_scatter", reference.reduce_scatter),
        ("reference.all_gather", reference.all_gather),
        ("reference.send_recv", lambda xs, **kw: reference.send_recv(xs[1] if type(xs) is list
                                                                     else xs, **kw)),
        ("EmulatedRanks.all_reduce", ranks.all_reduce),
        ("EmulatedRanks.reduce_scatter", ranks.reduce_scatter),
        ("EmulatedRanks.all_gather", ranks.all_gather),
        ("EmulatedRanks.send_recv", lambda xs, **kw: ranks.send_recv(xs[1] if type(xs) is list
                                                                     else xs, 0, 1, **kw)),
    ]  # fmt: skip


@pytest.mark.parametrize(("case", "inputs", "kind", "words"), _RANK_INPUTS,
                         ids=[c[0] for c in _RANK_INPUTS])  # fmt: skip
def test_ranks_of_one_process_reject_bad_inputs_naming_the_rank(case, inputs, kind, words):
    x = torch.randn(4, 32)
    for name, call in _rank_calls():
        xs, want = inputs(x), words
        if name.endswith("send_recv"):  # one tensor, the sender's: its words name rank 0
            if case in ("one tensor", "dtypes differ"):
                continue
            want = [w.replace("rank 1's", "rank 0's") for w in words]
        with pytest.raises(kind) as info:
            call(xs)
        assert all(w in str(info.value) for w in want), (name, str(info.value))


@pytest.mark.parametrize(
    "codec", ["none", "none-float32", "nvfp4", "mxfp4", fp4_kernels.FP4Quant(64)], ids=str
)
def test_ranks_of_one_process_read_a_negative_view_as_its_values(codec):
    """A lazily negated view gives the bits of the tensor it stands for, as a Communicator
    gives them (a view is no error there)."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 64, generator=g) for _ in range(2)]
    views = [(-x)._neg_view() for x in xs]  # shows x, holds -x
    assert all(v.is_neg() and torch.equal(v, x) for v, x in zip(views, xs, strict=True))
    ranks = reference.EmulatedRanks(2)
    for f in (reference.all_reduce, reference.reduce_scatter, reference.all_gather,
              ranks.all_reduce, ranks.reduce_scatter, ranks.all_gather):  # fmt: skip
        for got, want in zip(f(views, codec=codec), f(xs, codec=codec), strict=True):
            assert torch.equal(got, want)
    got = reference.send_recv(views[0], codec=codec)
    assert torch.equal(got, reference.send_recv(xs[0], codec=codec))
    assert torch.equal(ranks.send_recv(views[0], 0, 1, codec=codec),
                       ranks.send_recv(xs[0], 0, 1, codec=codec))  # fmt: skip


def _nested():
    return torch.nested.nested_tensor([torch.ones(2, 32), torch.ones(3, 32)], layout=torch.jagged)


def _stops_soon(pool, rank_fns, error, match):
    """``pool.run(rank_fns)`` raises the failing rank's ``error`` well within the pool's
    timeout of 60 s: the ranks that wait on it stop at once."""
    start = time.monotonic()
    with pytest.raises(error, match=match):
        pool.run(rank_fns)
    assert time.monotonic() - start < 30


def test_a_failing_rank_stops_the_others_and_the_group_goes_on():
    """Rank 1 raises before the exchange: rank 0, waiting at the exchange, stops at once
    (not after the timeout), the caller gets rank 1's error, and the next call works."""
    world = 2
    pool = reference._RankThreads(world, torch.device("cpu"), timeout_s=60.0)

    def exchange(t):
        recv = torch.empty(world, 4, dtype=torch.uint8)
        t.all_gather([(torch.full((1, 4), t.rank, dtype=torch.uint8), recv)])
        return recv

    def fail(t):
        raise RuntimeError("rank 1 failed")

    _stops_soon(pool, [exchange, fail], RuntimeError, "rank 1 failed")
    out = pool.run([exchange, exchange])
    assert [o[:, 0].tolist() for o in out] == [[0, 1], [0, 1]]


def test_a_receiver_whose_sender_fails_stops():
    pool = reference._RankThreads(2, torch.device("cpu"), timeout_s=60.0)

    def receive(t):
        t.recv([torch.empty(4, dtype=torch.uint8)], 0)

    def fail(t):
        raise ValueError("no send")

    _stops_soon(pool, [fail, receive], ValueError, "no send")


def test_a_collective_one_rank_never_calls_times_out():
    pool = reference._RankThreads(2, torch.device("cpu"), timeout_s=0.5)

    def exchange(t):
        t.all_gather([(torch.zeros(1, 4, dtype=torch.uint8),
                       torch.empty(2, 4, dtype=torch.uint8))])  # fmt: skip

    with pytest.raises(CommTimeoutError, match="did not take part"):
        pool.run([exchange, None])


# ------------------------------------------------------------------ NCCL, one GPU


def _gpu_world():
    return int(os.environ.get("FP4_COMM_TEST_RANKS", "2"))


@pytest.fixture(scope="module")
def nccl_cluster():
    from fp4_comm_cluster import Cluster, skip_unless_ranks_fit

    # several ranks on one GPU: NCCL's multi-rank mode; NVLink multicast off
    for k, v in {
        "NCCL_MULTI_RANK_GPU_ENABLE": "1",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }.items():
        os.environ.setdefault(k, v)  # fmt: skip
    skip_unless_ranks_fit(_gpu_world())  # no GPU, no NCCL, or one too old to share a GPU
    c = Cluster(_gpu_world(), timeout_s=60.0, gpu=True)
    yield c
    c.close()


@pytest.mark.gpu
def test_every_collective_equals_the_nccl_run(nccl_cluster):
    """NCCL with FP4_COMM_TEST_RANKS ranks (default 2; 4 too) against the reference on the
    GPU: the same bits (the CUDA kernels equal the CPU path bit for bit, and the sums are
    plain float32 adds in rank order)."""
    world = _gpu_world()
    real = nccl_cluster.run(_run_cases, world, CASES, "cuda")
    _assert_same(real, _reference_cases(world, CASES, "cuda"), CASES)
