"""examples/tp_train.py on two gloo processes: it trains (bf16 and NVFP4 on the wire), TP and
the pipeline with exact float32 communication match a one-process run of the same model, and
the entry point writes its record.

One pair of spawned workers runs every configuration (starting a process and compiling the
FP4 codec's CPU path cost seconds each); the corpus is the repository's own Markdown (real
English text that is always there), so CI needs no Debian package.
"""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing as mp
import os
import socket
import sys
import traceback
from pathlib import Path

import pytest

pytest.importorskip("fp4_comm")  # nox -s tests installs it; tests_train does not

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "packages" / "fp4_train" / "examples"
WORLD = 2
STEPS = 20
EXACT_STEPS = 4
LAYERS, D_MODEL = 2, 32
TINY = ["--layers", str(LAYERS), "--d-model", str(D_MODEL), "--heads", "2", "--seq-len", "32",
        "--batch", "4", "--lr", "3e-3", "--eval-every", "0", "--eval-batches", "2",
        "--timing-warmup", "0", "--quiet"]  # fmt: skip
# float32 unit roundoff
U32 = 2.0**-24


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(record):
    return [s["loss"] for s in record["steps"]]


def _worker(rank, port, corpus, out, conn):
    try:
        env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": WORLD, "MASTER_PORT": port}
        os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
        sys.path.insert(0, str(EXAMPLES))
        import torch.distributed as dist
        import tp_train

        import fp4_comm

        base = [*TINY, "--data", str(corpus)]
        res = {}
        # the entry point, as torchrun runs it (initializes gloo from the environment)
        res["bf16"] = _losses(tp_train.main([*base, "--steps", str(STEPS), "--out", str(out)]))
        comm = fp4_comm.Communicator.from_process_group(None, "cpu", 60.0, "first")
        solo = dist.new_group([0])  # every rank takes part in making it
        comm1 = fp4_comm.Communicator.from_process_group(solo, "cpu") if rank == 0 else None

        def run(*extra):
            args = tp_train.parse_args([*base, *extra])
            return _losses(tp_train.train(args, comm))

        res["nvfp4"] = run("--steps", str(STEPS), "--codec", "nvfp4", "--rounding", "stochastic")
        exact = ["--steps", str(EXACT_STEPS), "--codec", "none-float32"]
        res["tp_fp32"] = run(*exact)
        res["sp_fp32"] = run(*exact, "--sequence-parallel")
        res["native"] = run("--steps", str(EXACT_STEPS), "--codec", "native")
        res["pp_fp32"] = run(*exact, "--parallel", "pp", "--microbatches", "2")
        res["pp_fp4"] = run("--steps", "3", "--parallel", "pp", "--codec", "nvfp4")
        ef = ("--steps", "3", "--codec", "nvfp4", "--error-feedback")
        res["tp_ef"] = run(*ef)
        res["sp_ef"] = run(*ef, "--sequence-parallel")
        res["ef_buffers"] = sorted(comm.error_feedback.names())
        if rank == 0:
            args = tp_train.parse_args([*base, *exact])
            res["single"] = _losses(tp_train.train(args, comm1))
        dist.barrier()
        dist.destroy_process_group()
        conn.send(("ok", res))
    except BaseException:  # noqa: BLE001 - handed to the test, which fails with it
        conn.send(("error", traceback.format_exc()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_train")
    corpus = tmp / "corpus.txt"
    texts = sorted(ROOT.glob("docs/*.md")) + sorted(ROOT.glob("packages/*/README.md"))
    corpus.write_text("\n\n".join(p.read_text() for p in texts))
    ctx = mp.get_context("spawn")
    port = _free_port()
    conns, procs = [], []
    for rank in range(WORLD):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(rank, port, corpus, tmp / "out", child))
        p.start()
        conns.append(parent)
        procs.append(p)
    try:
        results = []
        for c in conns:
            if not c.poll(datetime.timedelta(minutes=5).total_seconds()):
                raise TimeoutError("a tp_train worker did not finish in 5 minutes")
            status, value = c.recv()
            if status != "ok":
                raise RuntimeError(value)
            results.append(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results, tmp / "out"


@pytest.mark.parametrize("config", ["bf16", "nvfp4"])
def test_trains(runs, config):
    results, _ = runs
    losses = results[0][config]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    # from ln(256) = 5.55 (uniform bytes) towards the unigram entropy of English text
    assert losses[0] > 5.0
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert results[1][config] == losses  # every rank ends the all-reduce with the same bits


@pytest.mark.parametrize("config", ["tp_fp32", "sp_fp32", "pp_fp32", "native"])
def test_exact_communication_matches_one_process(runs, config):
    results, _ = runs
    single, parallel = results[0]["single"], results[0][config]
    # The split changes only the order of float32 sums: a dot product of length K errs by at
    # most K u (u: the unit roundoff), the longest here the MLP's 4 d, once per layer in the
    # forward and twice in the backward; AdamW's normalized steps carry the difference on.
    rtol = 3 * LAYERS * 4 * D_MODEL * U32 * EXACT_STEPS
    assert len(parallel) == EXACT_STEPS
    for a, b in zip(single, parallel, strict=True):
        assert abs(a - b) <= rtol * abs(a), (single, parallel)


def test_pipeline_runs_with_fp4(runs):
    results, _ = runs
    losses = results[0]["pp_fp4"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert results[1]["pp_fp4"] == losses  # the last stage's loss, broadcast


def test_entry_point_writes_the_record(runs):
    _, out = runs
    record = json.loads((out / "tp_bf16_s0.json").read_text())
    assert record["world_size"] == WORLD and record["codec"] == "bf16"
    summary = record["summary"]
    assert 0 < summary["comm_share"] < 1 and summary["tokens_per_s_per_rank"] > 0
    assert math.isclose(summary["final_val_ppl"], math.exp(summary["final_val_loss"]))
    assert (out / "tp_bf16_s0.csv").read_text().startswith("step,loss,")


@pytest.mark.parametrize("config", ["tp_ef", "sp_ef"])
def test_error_feedback_runs_with_and_without_sequence_parallelism(runs, config):
    results, _ = runs
    losses = results[0][config]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert results[1][config] == losses
    # a residual buffer per site: the gradient's sum at each block input, the forward sum at
    # each block output (with SP too: reduce-scatter forward, reduce-scatter of the gradient)
    names = results[0]["ef_buffers"]
    assert any(n.endswith(".in.grad") for n in names) and any(n.endswith(".out") for n in names)


@pytest.mark.parametrize(
    "extra, why",
    [
        (["--device", "cpu"], "needs a GPU"),
        (["--parallel", "pp"], "tensor-parallel step only"),
        (["--rounding", "stochastic"], "same random words"),
        (["--optimizer", "sgd"], "adamw"),
    ],
)
def test_cuda_graph_refuses_what_it_cannot_replay(extra, why):
    sys.path.insert(0, str(EXAMPLES))
    import tp_train

    args = tp_train.parse_args(["--cuda-graph", *extra])
    device = __import__("torch").device("cuda" if "--device" not in extra else "cpu")
    with pytest.raises(SystemExit, match=why):
        tp_train._check_graph_args(args, device)
