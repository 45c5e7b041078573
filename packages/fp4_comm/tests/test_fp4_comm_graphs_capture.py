"""``fp4_comm.graphs.capture`` and ``capture_group`` on the CPU, with stand-ins for torch's
CUDA graph, stream and allocation: what runs inside the capture, what they return, and that a
capture whose call fails is ended before the error goes on.  (On GPUs the real captures are
exercised by ``test_fp4_comm_graphs`` and ``test_fp4_comm_nccl``, ``gpu``.)"""

import contextlib

import pytest
import torch

from fp4_comm import graphs


class _Graph:
    events: list

    def capture_begin(self, capture_error_mode):
        self.events.append(("begin", capture_error_mode))

    def capture_end(self):
        self.events.append(("end",))


@pytest.fixture
def events(monkeypatch):
    events = []
    monkeypatch.setattr(_Graph, "events", events, raising=False)
    monkeypatch.setattr(graphs.torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(graphs.torch.cuda, "Stream", lambda device: ("stream", device))
    monkeypatch.setattr(
        graphs.torch.cuda, "stream", lambda s: events.append(s) or contextlib.nullcontext()
    )
    monkeypatch.setattr(
        graphs,
        "_unfilled",
        lambda shape, dtype, device: (
            events.append(("alloc", shape)) or torch.ones(shape, dtype=dtype)
        ),
    )
    return events


def test_capture_runs_the_call_on_its_static_input_inside_the_capture(events):
    def run(static):
        events.append(("run", tuple(static.shape)))
        return static * 2

    graph, static, out = graphs.capture(run, "dev", (2, 3), torch.float32)
    assert isinstance(graph, _Graph) and static.shape == (2, 3) and torch.equal(out, static * 2)
    assert events == [
        ("stream", "dev"),
        ("begin", "thread_local"),
        ("alloc", (2, 3)),
        ("run", (2, 3)),
        ("end",),
    ]
    events.clear()
    graph, static, out = graphs.capture(lambda: events.append(("run",)) or 7, "dev", None, None)
    assert static is None and out == 7
    assert events == [("stream", "dev"), ("begin", "thread_local"), ("run",), ("end",)]


def test_capture_group_allocates_one_static_input_per_shape(events):
    graph, statics, out = graphs.capture_group(
        lambda xs: [x.sum() for x in xs], "dev", [(2,), (3,)], torch.float32
    )
    assert [tuple(x.shape) for x in statics] == [(2,), (3,)] and out == [2.0, 3.0]
    assert events == [
        ("stream", "dev"),
        ("begin", "thread_local"),
        ("alloc", (2,)),
        ("alloc", (3,)),
        ("end",),
    ]


@pytest.mark.parametrize("end_fails", [False, True])
@pytest.mark.parametrize("group", [False, True], ids=["capture", "capture_group"])
def test_a_failed_call_ends_the_capture_and_raises_its_own_error(
    events, monkeypatch, group, end_fails
):
    if end_fails:  # an invalidated capture's end raises too; the call's error is the one seen

        def end(self):
            events.append(("end",))
            raise RuntimeError("capture invalidated")

        monkeypatch.setattr(_Graph, "capture_end", end)

    def run(_):
        raise ValueError("the call failed")

    with pytest.raises(ValueError, match="the call failed"):
        if group:
            graphs.capture_group(run, "dev", [(1,)], torch.float32)
        else:
            graphs.capture(run, "dev", (1,), torch.float32)
    assert events[-1] == ("end",) and events.count(("end",)) == 1
