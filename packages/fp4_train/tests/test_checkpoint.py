"""fp4_train.experiments.checkpoint and the resumable runs of tp_train / emulated_tp: a run
stopped after step 2 of 4 and resumed from its checkpoint ends with the bits of the run that
was not stopped (every weight, Adam's moments, the communicators' counters and residuals, every
loss, evaluation and payload statistic), for nearest rounding, NVFP4 with stochastic rounding
and error feedback, the pipeline and sequence parallelism (emulated ranks), and tp_train on two
gloo processes; a checkpoint that drops one piece of the state (the call or send counters, the
residuals, the optimizer's or the schedule's state) resumes to other bits.  Then the pieces:
the shard paths, the atomic write, the random generators' round trip, the argument check, the
save/stop schedule, and emulated_sweep's pieces over two invocations.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from _processes import spawn, write_corpus

pytest.importorskip("fp4_comm")

from fp4_train.experiments import checkpoint, emulated_sweep, emulated_tp, tp_train  # noqa: E402

STEPS, STOP = 4, 2
BYTE = ["--model", "byte", "--layers", "2", "--d-model", "32", "--heads", "2"]
BASE = ["--device", "cpu", "--seq-len", "24", "--batch", "4", "--lr", "3e-3", "--steps",
        str(STEPS), "--eval-every", "2", "--eval-batches", "2", "--timing-warmup", "0",
        "--stats-every", "1", "--quiet", "--seed", "3", *BYTE]  # fmt: skip
NVFP4_SR_EF = ["--codec", "nvfp4", "--rounding", "stochastic", "--error-feedback"]
# (id, emulated ranks, arguments)
CONFIGS = {
    "tp2-g64-nearest": (2, ["--codec", "fp4quant-g64"]),
    "tp2-nvfp4-sr-ef": (2, NVFP4_SR_EF),
    "pp-nvfp4": (2, ["--codec", "nvfp4", "--parallel", "pp", "--microbatches", "2"]),
    # the residual stream's gradient: stochastic by default
    "sp2-g64": (2, ["--codec", "fp4quant-g64", "--sequence-parallel"]),
}
# what a step record holds besides its bits: its timings and the piece of the run it ran in
TIMING = ("step_ms", "comm_ms", "tokens_per_s_per_rank", "piece")


def _outcome(record):
    """What a run's bits decide in its record: every step's loss and learning rate, the
    evaluations, the payload statistics, the final evaluations (not the timings)."""
    return {
        "steps": [{k: v for k, v in s.items() if k not in TIMING} for s in record["steps"]],
        "evals": record["evals"],
        "wire": record["wire"],
        "final_evals": record["summary"]["final_evals"],
        "final_train_loss": record["summary"]["final_train_loss"],
    }


def _state_bits(state):
    """A checkpoint's runner state as flat {key: bytes} (bit equality, NaN included)."""
    out = {}

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            out[prefix] = (obj.dtype, tuple(obj.shape), obj.contiguous().numpy().tobytes())
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)
        else:
            out[prefix] = obj

    walk("", state)
    return out


def _emulated(tmp, name, ckpt, *extra):
    """``tp_train.train`` of emulated ranks, as ``emulated_tp`` runs it: its record (None if
    it stopped)."""
    tp, argv = CONFIGS[name]
    args = tp_train.parse_args([*BASE, *argv, "--data", str(tmp / "corpus.txt"),
                                "--checkpoint", str(ckpt), *extra])  # fmt: skip
    return tp_train.train(args, None, torch.device("cpu"), emulated_tp.make_runner(tp))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoint")
    write_corpus(path / "corpus.txt")
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp):
    """Each configuration run through: its record and its final checkpoint."""
    out = {}
    for name in CONFIGS:
        record = _emulated(tmp, name, tmp / f"{name}-whole")
        out[name] = record, checkpoint.load(tmp / f"{name}-whole" / "rank0.pt")
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_stopped_and_resumed_run_has_the_bits_of_one_run(tmp, uninterrupted, name):
    ckpt = tmp / f"{name}-pieces"
    assert _emulated(tmp, name, ckpt, "--stop-at-step", str(STOP)) is None
    stopped = checkpoint.load(ckpt / "rank0.pt")
    assert len(stopped["records"]["steps"]) == STOP and stopped["pieces"] == 1
    record = _emulated(tmp, name, ckpt)
    whole, whole_state = uninterrupted[name]
    assert record["pieces"] == 2 and whole["pieces"] == 1
    assert [st["piece"] for st in record["steps"]] == [1] * STOP + [2] * (STEPS - STOP)
    assert _outcome(record) == _outcome(whole)
    resumed = checkpoint.load(ckpt / "rank0.pt")
    assert _state_bits(resumed["runner"]) == _state_bits(whole_state["runner"])
    assert resumed["records"]["evals"] == whole_state["records"]["evals"]


def _drop_calls(state):
    for comm in state["runner"]["communicators"]:
        comm["calls"] = 0


def _drop_sends(state):
    for comm in state["runner"]["communicators"]:
        comm["sends"] = 0


def _drop_residuals(state):
    for comm in state["runner"]["communicators"]:
        comm["error_feedback"] = {"residuals": {}, "nonfinite_blocks": {}}


def _drop_optimizer(state):
    state["runner"]["optimizer"]["state"] = {}


def _drop_schedule(state):
    state["runner"]["scheduler"]["last_epoch"] = 0


# (piece dropped, configuration in which it decides bits)
DROPPED = [
    (_drop_calls, "tp2-nvfp4-sr-ef"),
    (_drop_sends, "pp-nvfp4"),
    (_drop_residuals, "tp2-nvfp4-sr-ef"),
    (_drop_optimizer, "tp2-g64-nearest"),
    (_drop_schedule, "tp2-g64-nearest"),
]


@pytest.mark.parametrize(("drop", "name"), DROPPED, ids=[d[0].__name__ for d in DROPPED])
def test_a_checkpoint_without_a_piece_of_the_state_resumes_to_other_bits(
    tmp, uninterrupted, monkeypatch, drop, name
):
    """Each piece matters: resumed without it (the rest restored), the run's weights and
    losses differ from the run that was not stopped, so the test above would catch its loss."""
    ckpt = tmp / f"{name}-{drop.__name__}"
    assert _emulated(tmp, name, ckpt, "--stop-at-step", str(STOP)) is None
    load = checkpoint.load

    def dropping(path):
        state = load(path)
        drop(state)
        return state

    monkeypatch.setattr(checkpoint, "load", dropping)
    record = _emulated(tmp, name, ckpt)
    monkeypatch.setattr(checkpoint, "load", load)
    whole, whole_state = uninterrupted[name]
    ours, theirs = _outcome(record), _outcome(whole)
    assert ours["steps"][:STOP] == theirs["steps"][:STOP]
    assert ours != theirs
    model = _state_bits(checkpoint.load(ckpt / "rank0.pt")["runner"]["model"])
    assert model != _state_bits(whole_state["runner"]["model"])


def test_the_entry_point_stops_at_its_time_limit_with_status_75_and_resumes(tmp, uninterrupted):
    """``--stop-at-s``: a limit the first step already passes stops after it; each call
    then runs one step until the run is done; the summary is the unstopped run's."""
    tp, argv = CONFIGS["tp2-nvfp4-sr-ef"]
    ckpt, out = tmp / "timed", tmp / "timed-out"
    cmd = [*BASE, *argv, "--tp", str(tp), "--data", str(tmp / "corpus.txt"), "--checkpoint",
           str(ckpt), "--out", str(out)]  # fmt: skip
    for done in range(1, STEPS):
        with pytest.raises(SystemExit) as stop:
            emulated_tp.main([*cmd, "--stop-at-s", "1e-9"])
        assert stop.value.code == checkpoint.EX_TEMPFAIL == 75
        assert len(checkpoint.load(ckpt / "rank0.pt")["records"]["steps"]) == done
        assert not list(out.glob("*.json"))
    (summary,) = emulated_tp.main([*cmd, "--stop-at-s", "1e-9"])
    assert summary["pieces"] == STEPS
    whole = emulated_tp.summarize(uninterrupted["tp2-nvfp4-sr-ef"][0], tp_train.parse_args(
        [*BASE, *argv]), tp, 0.0)  # fmt: skip
    for key in ("final_val_loss", "final_train_loss", "final_evals", "evals",
                "train_loss_curve", "wire"):  # fmt: skip
        assert summary[key] == whole[key], key
    assert json.loads(next(out.glob("*.json")).read_text())["pieces"] == STEPS


def test_several_seeds_keep_a_checkpoint_each(tmp_path):
    assert emulated_tp.checkpoint_path(None, "run", True) is None
    assert emulated_tp.checkpoint_path(tmp_path / "c", "run", False) == tmp_path / "c"
    assert emulated_tp.checkpoint_path(tmp_path / "c", "run", True) == tmp_path / "c" / "run"
    with pytest.raises(SystemExit, match="with several --seeds give a folder"):
        emulated_tp.checkpoint_path(tmp_path / "c.pt", "run", True)


def test_resuming_with_other_arguments_names_them(tmp, uninterrupted):
    match = r"--lr 0\.003 there, 0\.002 here.*arguments it was started with"
    with pytest.raises(ValueError, match=match):
        _emulated(tmp, "tp2-g64-nearest", tmp / "tp2-g64-nearest-whole", "--lr", "2e-3")


def test_a_checkpoint_path_of_another_kind_is_refused_before_the_run(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "folder.pt").mkdir()
    for path, message in [("notes.txt", "a file that does not end in .pt"),
                          ("folder.pt", "a folder ending in .pt")]:  # fmt: skip
        with pytest.raises(SystemExit):
            tp_train.parse_args(["--checkpoint", str(tmp_path / path)])
        assert f"--checkpoint {tmp_path / path}: {message}" in capsys.readouterr().err


def test_an_unreadable_checkpoint_is_named(tmp, uninterrupted):
    whole = (tmp / "tp2-g64-nearest-whole" / "rank0.pt").read_bytes()
    for name, data in [("truncated", whole[: len(whole) // 2]), ("garbage", b"\0" * 100)]:
        (tmp / name).mkdir(exist_ok=True)
        (tmp / name / "rank0.pt").write_bytes(data)
        with pytest.raises(SystemExit, match=r"^--checkpoint .*rank0\.pt \(.*\) is not a "
                                             r"readable checkpoint; delete it"):  # fmt: skip
            _emulated(tmp, "tp2-g64-nearest", tmp / name)


def test_resuming_with_another_tp_names_it(tmp, capsys):
    argv = [*BASE, "--data", str(tmp / "corpus.txt"), "--checkpoint", str(tmp / "tp-change")]
    with pytest.raises(SystemExit) as stop:
        emulated_tp.main([*argv, "--tp", "2", "--stop-at-step", "1"])
    assert stop.value.code == checkpoint.EX_TEMPFAIL
    assert checkpoint.load(tmp / "tp-change" / "rank0.pt")["config"]["tp"] == 2
    with pytest.raises(ValueError, match="--tp 2 there, 1 here"):
        emulated_tp.main([*argv, "--tp", "1"])
    # a checkpoint that does not record --tp (an older one) is compared without it
    args = tp_train.parse_args(BASE)
    checkpoint.check_config(checkpoint.config_of(args), args, "c", {"tp": 2})


# ------------------------------------------------------------------ tp_train, 2 gloo processes


def _gloo_worker(rank, corpus, folder):
    """Each configuration through ``tp_train.main`` (a fresh communicator each call), whole
    and in two pieces; the records' outcomes and this rank's final checkpoints."""
    res = {}
    for name, argv in [("tp-nvfp4-sr-ef", NVFP4_SR_EF), ("pp-nvfp4", CONFIGS["pp-nvfp4"][1])]:
        cmd = [*BASE, *argv, "--data", str(corpus)]
        whole = tp_train.main([*cmd, "--checkpoint", f"{folder}/{name}-whole"])
        pieces = f"{folder}/{name}-pieces"
        try:
            # a checkpoint after every step, and a time limit not reached: rank 0's clock
            # decides both, broadcast to the other rank after each step
            tp_train.main([*cmd, "--checkpoint", pieces, "--stop-at-step", str(STOP),
                           "--checkpoint-every-s", "1e-9", "--stop-at-s", "1e6"])  # fmt: skip
        except SystemExit as stop:
            res[f"{name} status"] = stop.code
        resumed = tp_train.main([*cmd, "--checkpoint", pieces])
        res[name] = [_outcome(whole), _outcome(resumed), resumed["pieces"]]
        res[f"{name} states"] = [
            _state_bits(checkpoint.load(f"{path}/rank{rank}.pt")["runner"])
            for path in (f"{folder}/{name}-whole", pieces)
        ]
    return res


@pytest.fixture(scope="module")
def gloo(tmp):
    return spawn(2, _gloo_worker, tmp / "corpus.txt", str(tmp / "gloo"))


@pytest.mark.parametrize("name", ["tp-nvfp4-sr-ef", "pp-nvfp4"])
def test_tp_train_on_two_processes_resumes_bit_for_bit(gloo, name):
    ranks = gloo
    for rank, res in enumerate(ranks):
        assert res[f"{name} status"] == checkpoint.EX_TEMPFAIL
        whole, resumed, pieces = res[name]
        assert resumed == whole and pieces == 2
        whole_state, resumed_state = res[f"{name} states"]
        assert resumed_state == whole_state, rank
        assert whole_state["/communicators/0/calls"] + whole_state["/communicators/0/sends"] > 0
    # the ranks' shards differ (their shards of the weights, their residuals)
    assert ranks[0][f"{name} states"][0] != ranks[1][f"{name} states"][0]


# ------------------------------------------------------------------ the pieces


def test_each_piece_of_a_run_leaves_its_warmup_steps_out_of_the_timing():
    pieces = [(90, 1), (50, 1), (10, 1), (80, 2), (12, 2)]  # (step ms, piece) of steps 0-4
    steps = [{"step": i, "step_ms": ms, "piece": p} for i, (ms, p) in enumerate(pieces)]
    assert [st["step"] for st in tp_train.timed_steps(steps, 1)] == [1, 2, 4]
    assert [st["step"] for st in tp_train.timed_steps(steps, 2)] == [2]
    assert tp_train.timed_steps(steps, 3) == steps  # none left: every step
    # a record of one piece, without the key (records of runs never resumed)
    plain_steps = [{"step": i, "step_ms": 1.0} for i in range(4)]
    assert tp_train.timed_steps(plain_steps, 1) == plain_steps[1:]


def test_the_peak_memory_is_the_most_of_every_piece(monkeypatch):
    run = tp_train.Training.__new__(tp_train.Training)  # only what peak_memory_gb reads
    run.device, run.memory_gb = torch.device("cuda", 0), 3.0  # an earlier piece's peak
    for now_gib, peak in [(2, 3.0), (5, 5.0)]:
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d, n=now_gib: n * 2**30)
        assert run.peak_memory_gb() == peak
    run.memory_gb = None  # the first piece
    assert run.peak_memory_gb() == 5.0
    run.device = torch.device("cpu")
    assert run.peak_memory_gb() is None


def test_shard_paths():
    assert checkpoint.shard_path("run.pt", 0, 1).name == "run.pt"
    assert checkpoint.shard_path("d/run.pt", 1, 2).as_posix() == "d/run.rank1.pt"
    assert checkpoint.shard_path("d/run", 1, 2).as_posix() == "d/run/rank1.pt"
    assert checkpoint.shard_path("d/run", 0, 1).as_posix() == "d/run/rank0.pt"


def test_the_write_is_atomic(tmp_path, monkeypatch):
    """A write that fails half-way leaves the previous checkpoint whole, and no litter."""
    path = tmp_path / "c" / "rank0.pt"
    checkpoint.save(path, {"step": 1, "w": torch.arange(4.0)})
    save = torch.save

    def half(obj, f):
        f.write(b"torn")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", half)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, {"step": 2, "w": torch.zeros(4)})
    monkeypatch.setattr(torch, "save", save)
    state = checkpoint.load(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.arange(4.0))
    assert sorted(p.name for p in path.parent.iterdir()) == ["rank0.pt"]


def test_the_random_generators_continue_where_they_were(tmp_path):
    """Saved, drawn from and restored, the global generators draw the same numbers again,
    whatever their state (nothing is seeded: the draws are compared with themselves)."""
    device = torch.device("cpu")
    legacy, python = np.random, random  # the global generators that rng_state saves
    legacy.randn()  # an odd number of normal draws: numpy keeps the pair's second one
    checkpoint.save(tmp_path / "r.pt", {"rng": checkpoint.rng_state(device)})

    def draw():
        return (torch.rand(5).tolist(), legacy.rand(5).tolist(), legacy.randn(3).tolist(),
                [python.random() for _ in range(5)])  # fmt: skip

    first = draw()
    checkpoint.set_rng_state(checkpoint.load(tmp_path / "r.pt")["rng"], device)
    assert draw() == first


class _Args:
    def __init__(self, every_s=0.0, stop_at_step=None, stop_at_s=None):
        self.checkpoint_every_s = every_s
        self.stop_at_step, self.stop_at_s = stop_at_step, stop_at_s


def test_the_schedule_saves_and_stops_when_told(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(checkpoint.time, "monotonic", lambda: now[0])
    s = checkpoint.Schedule(_Args(stop_at_step=3))
    assert [s.after(n) for n in (1, 2, 3)] == [(False, False), (False, False), (True, True)]
    s = checkpoint.Schedule(_Args(every_s=10.0, stop_at_s=25.0))
    out = []
    for t in (5, 11, 15, 22, 26):
        now[0] = 100.0 + t
        out.append(s.after(0))
    assert out == [(False, False), (True, False), (False, False), (True, False), (True, True)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stop-at-step", "2"], "give it a place with --checkpoint"),
        (["--stop-at-s", "60"], "give it a place with --checkpoint"),
        (["--checkpoint", "c", "--stop-at-step", "0"], "--stop-at-step 0: at least 1"),
        (["--checkpoint", "c", "--stop-at-s", "0"], "--stop-at-s 0.0: a finite number > 0"),
        (["--checkpoint", "c", "--stop-at-s", "nan"], "--stop-at-s nan: a finite number > 0"),
        (["--checkpoint", "c", "--checkpoint-every-s", "-1"], "a finite number >= 0"),
        (["--checkpoint", "c", "--checkpoint-every-s", "nan"], "a finite number >= 0"),
        (["--checkpoint", "c", "--cuda-graph"], "not with --cuda-graph"),
    ],
)
def test_checkpoint_arguments_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        tp_train.parse_args(argv)
    assert message in capsys.readouterr().err


SDP = ("flash_sdp", "mem_efficient_sdp", "cudnn_sdp")


@pytest.fixture
def determinism(monkeypatch):
    """``tp_train.set_deterministic``'s process-wide switches, put back after the test."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
    enabled = {name: getattr(torch.backends.cuda, f"{name}_enabled")() for name in SDP}
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    for name, on in enabled.items():
        getattr(torch.backends.cuda, f"enable_{name}")(on)


def test_deterministic_mode_turns_its_switches(determinism):
    tp_train.set_deterministic()
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not any(getattr(torch.backends.cuda, f"{n}_enabled")() for n in SDP)
    assert torch.backends.cuda.math_sdp_enabled()


# ------------------------------------------------------------------ emulated_sweep in pieces

TINY = ["--model", "byte", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len",
        "16", "--batch", "2", "--steps", "3", "--eval-every", "0", "--eval-batches", "1",
        "--stats-every", "1", "--timing-warmup", "0", "--device", "cpu", "--tp", "2"]  # fmt: skip


def test_a_sweep_stops_its_runs_and_the_next_invocation_resumes_them(tmp, monkeypatch, capsys):
    configs = [("nvfp4-sr-ef", NVFP4_SR_EF), ("pp", ["--parallel", "pp", "--codec", "nvfp4"])]
    preset = {"args": [*TINY, "--data", str(tmp / "corpus.txt")], "seeds": [0],
              "configs": configs}  # fmt: skip
    monkeypatch.setitem(emulated_sweep.PRESETS, "cpu-tiny", preset)
    out, ckpt = tmp / "sweep", tmp / "sweep-ckpt"
    base = ["--preset", "cpu-tiny", "--out", str(out), "--jobs", "2", "--checkpoint-dir", str(ckpt)]
    # stopped after one step each: the run's own --stop-at-step, as a time limit would stop it
    assert emulated_sweep.main([*base, "--", "--stop-at-step", "1"]) == 75
    names = ["byte_pp2_nvfp4_grad-nvfp4-sr_s0", "byte_tp2_nvfp4_sr_ef_s0"]
    said = capsys.readouterr().out
    assert all(f"resumable: {n}" in said for n in names) and not list(out.glob("*.json"))
    assert sorted(p.name for p in ckpt.iterdir()) == names
    # what is left of a resumed run is what the sweep expects of it: 2 of its 3 steps
    assert [checkpoint.progress(ckpt / n) for n in names] == [(1, 3), (1, 3)]
    assert checkpoint.progress(ckpt / "none") is None
    sweep = emulated_sweep.Sweep(emulated_sweep.parse_args([*base, "--estimate-s", "300"]), [])
    assert [sweep.estimate(n) for n in [*names, "none"]] == pytest.approx([200.0, 200.0, 300.0])
    # too little time left to start anything
    assert emulated_sweep.main([*base, "--stop-at-s", "10", "--min-piece-s", "20"]) == 75
    said = capsys.readouterr().out
    assert all(f"left out (time limit): {n}" in said for n in names)
    assert emulated_sweep.main([*base, "--stop-at-s", "500"]) == 0
    said = capsys.readouterr().out
    assert all(f"finished: {n}" in said for n in names)
    assert not list(ckpt.iterdir())  # a finished run's checkpoint is removed
    whole = tmp / "sweep-whole"
    assert emulated_sweep.main(["--preset", "cpu-tiny", "--out", str(whole), "--jobs", "2"]) == 0
    said = capsys.readouterr().out
    for name in names:
        pieces = json.loads((out / f"{name}.json").read_text())
        one = json.loads((whole / f"{name}.json").read_text())
        assert pieces["pieces"] == 2 and one["pieces"] == 1
        # the sweep's output keeps each finished run's loss (its summary may not travel)
        assert f"finished: {name} (final val loss {one['final_val_loss']:.4f})" in said
        for key in ("final_val_loss", "train_loss_curve", "evals", "wire", "final_evals"):
            assert pieces[key] == one[key], (name, key)
    capsys.readouterr()
    assert emulated_sweep.main(base) == 0  # all finished: nothing runs
    assert "finished" not in capsys.readouterr().out


def test_a_checkpoint_that_cannot_be_read_has_no_progress(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "rank0.pt").write_bytes(b"not a checkpoint")
    torch.save({"records": {}}, tmp_path / "other.pt")
    assert checkpoint.progress(tmp_path / "run") is None
    assert checkpoint.progress(tmp_path / "other.pt") is None


def test_a_sweep_piece_gets_its_checkpoint_and_the_time_left():
    args = emulated_sweep.parse_args(["--preset", "tp4", "--out", "o", "--checkpoint-dir", "c",
                                      "--stop-at-s", "540"])  # fmt: skip
    assert emulated_sweep.piece_args(args, "run", 40.0) == [
        "--checkpoint", os.path.join("c", "run"), "--stop-at-s", "500.0"]  # fmt: skip
    with pytest.raises(SystemExit):
        emulated_sweep.parse_args(["--preset", "tp4", "--out", "o", "--stop-at-s", "540"])


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_emulated_tp_resumes_bit_for_bit_on_the_gpu(tmp_path, determinism):
    """On CUDA (bfloat16 autocast, deterministic kernels): 2 emulated ranks, NVFP4 with SR and
    error feedback, stopped after 2 of 4 steps and resumed, against the run not stopped."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    corpus = write_corpus(tmp_path / "corpus.txt")
    cmd = [*BASE, *NVFP4_SR_EF, "--device", "cuda", "--deterministic", "--data", str(corpus),
           "--tp", "2"]  # fmt: skip
    (whole,) = emulated_tp.main([*cmd, "--checkpoint", str(tmp_path / "whole")])
    with pytest.raises(SystemExit) as stop:
        emulated_tp.main([*cmd, "--checkpoint", str(tmp_path / "pieces"), "--stop-at-step", "2"])
    assert stop.value.code == 75
    (resumed,) = emulated_tp.main([*cmd, "--checkpoint", str(tmp_path / "pieces")])
    for key in ("final_val_loss", "train_loss_curve", "evals", "wire", "final_evals"):
        assert resumed[key] == whole[key], key
    states = [checkpoint.load(tmp_path / p / "rank0.pt")["runner"] for p in ("whole", "pieces")]
    assert _state_bits(states[0]) == _state_bits(states[1])
    assert states[0]["communicators"][0]["error_feedback"]["residuals"]
