"""fp4_train.experiments.tp_train on two gloo processes (on the CPU, whatever GPUs the machine
has): it trains (bf16 and NVFP4 on the wire), TP and the pipeline with exact float32
communication match a one-process run of the same model, the forward and gradient policies
reach the boundary, and the entry point writes its record; the example scripts are its command
lines.

One pair of spawned workers runs every configuration (starting a process and compiling the
FP4 codec's CPU path cost seconds each); the corpus is the repository's own Markdown (real
English text that is always there), so CI needs no Debian package.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from unittest import mock

import pytest
from _processes import ROOT, spawn, write_corpus

pytest.importorskip("fp4_comm")  # nox -s tests installs it; tests_train does not

EXAMPLES = ROOT / "packages" / "fp4_train" / "examples"
WORLD = 2
STEPS = 20
EXACT_STEPS = 4
LAYERS, D_MODEL = 2, 32
# --device cpu: gloo on the CPU even where there are GPUs (a machine with one GPU has no GPU
# for rank 1)
TINY = ["--device", "cpu", "--layers", str(LAYERS), "--d-model", str(D_MODEL), "--heads", "2",
        "--seq-len", "32", "--batch", "4", "--lr", "3e-3", "--eval-every", "0",
        "--eval-batches", "2", "--timing-warmup", "0", "--stats-every", "1", "--quiet"]  # fmt: skip
# float32 unit roundoff
U32 = 2.0**-24


def _losses(record):
    return [s["loss"] for s in record["steps"]]


def _worker(rank, corpus, out):
    import torch.distributed as dist

    import fp4_comm
    from fp4_train.experiments import tp_train

    base = [*TINY, "--data", str(corpus)]
    res = {}
    # the entry point, as torchrun runs it (initializes gloo from the environment)
    res["bf16"] = _losses(tp_train.main([*base, "--steps", str(STEPS), "--out", str(out)]))
    comm = fp4_comm.Communicator.from_process_group(None, "cpu", 60.0, "first")
    solo = dist.new_group([0])  # every rank takes part in making it
    comm1 = fp4_comm.Communicator.from_process_group(solo, "cpu") if rank == 0 else None

    def run(*extra, record=None):
        args = tp_train.parse_args([*base, *extra])
        out = tp_train.train(args, comm)
        if record is not None:
            res[record] = {k: out[k] for k in ("name", "wire", "summary", "grad_rounding")}
        return _losses(out)

    res["nvfp4"] = run("--steps", str(STEPS), "--codec", "nvfp4", "--rounding", "stochastic")
    exact = ["--steps", str(EXACT_STEPS), "--codec", "none-float32"]
    res["tp_fp32"] = run(*exact)
    res["sp_fp32"] = run(*exact, "--sequence-parallel")
    res["native"] = run("--steps", str(EXACT_STEPS), "--codec", "native")
    res["pp_fp32"] = run(*exact, "--parallel", "pp", "--microbatches", "2")
    res["pp_fp4"] = run(
        "--steps", "3", "--parallel", "pp", "--codec", "nvfp4", record="pp_fp4_record"
    )
    # forward only: the gradient crosses in bf16, so the boundary's backward SQNR is bf16's
    run(
        "--steps",
        "2",
        "--parallel",
        "pp",
        "--codec",
        "fp4quant-g64",
        "--grad-codec",
        "none",
        record="pp_fwd_record",
    )
    run("--steps", "2", "--sequence-parallel", "--codec", "nvfp4", record="sp_record")
    ef = ("--steps", "3", "--codec", "nvfp4", "--error-feedback")
    res["tp_ef"] = run(*ef)
    res["sp_ef"] = run(*ef, "--sequence-parallel")
    res["ef_buffers"] = sorted(comm.error_feedback.names())
    if rank == 0:
        args = tp_train.parse_args([*base, *exact])
        res["single"] = _losses(tp_train.train(args, comm1))
    dist.barrier()
    dist.destroy_process_group()
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_train")
    corpus = write_corpus(tmp / "corpus.txt")
    return spawn(WORLD, _worker, corpus, tmp / "out", minutes=15), tmp / "out"


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
        # the residual stream's gradient is stochastic by default under SP
        (["--sequence-parallel"], "--grad-rounding nearest"),
        (["--optimizer", "sgd"], "adamw"),
        (["--check-finite"], "synchronizes on every op"),
    ],
)
def test_cuda_graph_refuses_what_it_cannot_replay(extra, why):
    from fp4_train.experiments import tp_train

    args = tp_train.parse_args(["--cuda-graph", *extra])
    device = __import__("torch").device("cuda" if "--device" not in extra else "cpu")
    with pytest.raises(SystemExit, match=why):
        tp_train.check_graph_args(args, device)


def test_pipeline_boundary_records_its_policies_and_payloads(runs):
    """The pipeline's default: FP4 forward with nearest rounding, its gradient stochastic;
    every step's RMS and SQNR of both directions (SQNR of a 4-bit code: 10-25 dB; of bf16
    values: above 40 dB); the final checkpoint also evaluated with an exact boundary."""
    results, _ = runs
    rec = results[0]["pp_fp4_record"]
    assert rec["name"] == "pp_nvfp4_grad-nvfp4-sr_s0" and rec["grad_rounding"] == "stochastic"
    by_dir = {}
    for w in rec["wire"]:
        assert w["site"] == "boundary" and w["op"] == "send" and w["payloads"] == 2
        by_dir.setdefault(w["direction"], []).append(w)
    assert sorted(by_dir) == ["backward", "forward"]
    assert [w["step"] for w in by_dir["forward"]] == [0, 1, 2]
    for w in by_dir["forward"] + by_dir["backward"]:
        assert w["rms"] > 0 and 10 < w["sqnr_db"] < 25
    evals = rec["summary"]["final_evals"]
    assert set(evals) == {"as_trained", "none-float32"}
    assert evals["none-float32"] != evals["as_trained"]
    assert abs(evals["none-float32"] - evals["as_trained"]) < 0.1

    fwd_only = results[0]["pp_fwd_record"]
    assert fwd_only["name"] == "pp_fp4quant-g64_grad-bf16_s0"
    sqnr = {w["direction"]: w["sqnr_db"] for w in fwd_only["wire"] if w["step"] == 1}
    assert 10 < sqnr["forward"] < 25 and sqnr["backward"] > 40


def test_sequence_parallel_records_every_site(runs):
    results, _ = runs
    rec = results[0]["sp_record"]
    assert rec["grad_rounding"] == "stochastic"  # the residual stream's gradient
    seen = {(w["site"], w["direction"], w["op"]) for w in rec["wire"]}
    assert seen == {
        ("enter", "forward", "all_gather"),
        ("enter", "backward", "reduce_scatter"),
        ("exit", "forward", "reduce_scatter"),
        ("exit", "backward", "all_gather"),
    }
    for w in rec["wire"]:
        # LAYERS blocks of two sub-blocks, on both ranks
        assert w["payloads"] == 2 * LAYERS * WORLD


@pytest.mark.parametrize("script", ["tp_train.py", "tp_sweep.py", "tp_summary.py"])
def test_example_scripts_are_the_command_lines(script):
    out = subprocess.run([sys.executable, str(EXAMPLES / script), "--help"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:")
    assert len((EXAMPLES / script).read_text().splitlines()) < 20


def test_sweep_lists_a_preset_without_running_it(capsys):
    from fp4_train.experiments import tp_sweep

    assert tp_sweep.main(["--preset", "cpu-boundary", "--out", "/nonexistent", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines]
    assert len(names) == 18 * 3 and "pp_fwd-rn_bwd-sr_s2" in names
    assert all("-m fp4_train.experiments.tp_train" in line for line in lines)


def test_every_run_of_every_sweep_preset_passes_the_checks():
    """tp_sweep's presets: each run's arguments parse (a run refused at its start would
    leave a hole in the study)."""
    from fp4_train.experiments import tp_sweep, tp_train

    for p in tp_sweep.PRESETS.values():
        for _, argv, *_ in p["runs"]:
            tp_train.parse_args([*p["common"], *argv, "--device", "cpu"], world_size=2)


@pytest.mark.parametrize("preset", ["cpu-boundary", "cpu-levers", "h200-boundary"])
def test_every_codec_a_boundary_preset_names_is_known_and_pairs_with_its_bf16(preset):
    from fp4_comm import get_codec
    from fp4_train.experiments import tp_sweep, tp_train

    common, runs = tp_sweep.PRESETS[preset]["common"], tp_sweep.PRESETS[preset]["runs"]
    names = [run[0] for run in runs]
    for name, argv, *_ in runs:
        args = tp_train.parse_args([*common, *argv, "--device", "cpu"], world_size=2)
        for policy in tp_train.policies(args):
            get_codec(policy.codec)  # raises on a codec it does not know
        layout = name.partition("_")[0]
        assert f"{layout}_bf16" in names, name  # boundary_study pairs each with it


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seeds", "-1"], "--seeds: -1 is not in [0, 2**32)"),
        (["--seeds", "0", "0"], "--seeds 0 0: a seed given twice"),
        (["--seeds"], "--seeds: expected at least one argument"),
        (["--only"], "--only: name at least one run"),
        (["--order", "tp_bf16_s0", "tp_nope_s0"], "--order tp_nope_s0: not a run of --preset"),
        (["--out", "FILE"], "exists and is not a folder; name a folder"),
    ],
)
def test_sweep_refuses_arguments_that_cannot_mean_what_they_say(argv, message, tmp_path, capsys):
    from fp4_train.experiments import tp_sweep

    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / a) if a == "FILE" else a for a in argv]
    with pytest.raises(SystemExit) as stop, mock.patch("subprocess.run") as run:
        tp_sweep.main(["--out", str(tmp_path / "out"), "--no-summary", *argv])
    assert stop.value.code == 2 and not run.called
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--error-feedback", "--grad-error-feedback"])
def test_pipeline_refuses_error_feedback(flag):
    """A send's payload is not a sum: error feedback asked for in the pipeline is an error,
    not silently nothing."""
    from types import SimpleNamespace

    import torch

    from fp4_train.experiments import tp_train

    with pytest.raises(SystemExit):  # named on the command line
        tp_train.parse_args(["--parallel", "pp", "--codec", "nvfp4", flag])
    args = tp_train.parse_args(["--parallel", "pp", "--codec", "nvfp4"])
    setattr(args, flag[2:].replace("-", "_"), True)  # and by the Runner of other callers
    comm = SimpleNamespace(world_size=2, rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="the pipeline's sends have none"):
        tp_train.Runner(args, comm, torch.device("cpu"))


@pytest.mark.parametrize(
    ("argv", "gb"),
    [([], None), (["--error-feedback"], 16.0), (["--grad-error-feedback"], 16.0),
     (["--error-feedback", "--no-grad-error-feedback"], 16.0), (["--graph-cache-gb", "2"], 2.0),
     (["--error-feedback", "--graph-cache-gb", "0.25"], 0.25)],
)  # fmt: skip
def test_graph_cache_is_sized_for_error_feedback_sites(argv, gb, monkeypatch):
    """Every error-feedback site is a kind of call of its own: with error feedback on (or
    --graph-cache-gb given) the communicator's graph cache is bounded by GiB of inputs, not by
    fp4_comm's default 8 graphs; the entry point passes it to ``Communicator.from_env``."""
    import fp4_comm
    from fp4_train.experiments import tp_train

    args = tp_train.parse_args(["--codec", "nvfp4", *argv])
    want = None if gb is None else (tp_train.GRAPH_CACHE_GRAPHS, int(gb * 2**30))
    assert tp_train.graph_cache_bounds(args) == want
    seen = {}

    class Stop(Exception):
        pass

    def from_env(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RANK", "0")  # as under torchrun
    monkeypatch.setattr(fp4_comm.Communicator, "from_env", from_env)
    with pytest.raises(Stop):
        tp_train.main(["--device", "cpu", "--codec", "nvfp4", *argv])
    assert seen["graph_cache"] == want


@pytest.mark.parametrize("gb", ["0", "-1", "nan", "1e-12", "inf"])
def test_graph_cache_gb_must_be_positive(gb, capsys):
    from fp4_train.experiments import tp_train

    with pytest.raises(SystemExit):
        tp_train.parse_args(["--graph-cache-gb", gb])
    assert f"--graph-cache-gb {float(gb)}: a finite number of GiB, more than 0" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("scale", ["3", "0", "-2", "0.3", "nan", "inf", "2e30", "1e-30", "six"])
def test_loss_scale_must_be_a_power_of_two(scale, capsys):
    from fp4_train.experiments import tp_train

    with pytest.raises(SystemExit):
        tp_train.parse_args(["--loss-scale", scale])
    err = capsys.readouterr().err
    assert f"--loss-scale: {scale!r}: a power of two from 2**-64 to 2**64" in err, err


def test_loss_scale_in_the_run_name():
    from fp4_train.experiments import tp_train

    assert tp_train.parse_args(["--loss-scale", "65536"]).loss_scale == 65536.0
    assert tp_train.parse_args(["--loss-scale", "0.015625"]).loss_scale == 2.0**-6
    small = tp_train.parse_args(["--codec", "tahquant-grad", "--loss-scale", "0.015625"])
    assert tp_train.run_name(small) == "tp_tahquant-grad_ls1by64_s0"
    named = tp_train.run_name(tp_train.parse_args(["--codec", "nvfp4", "--loss-scale", "1024"]))
    assert named == "tp_nvfp4_ls1024_s0"
    assert tp_train.run_name(tp_train.parse_args(["--codec", "nvfp4", "--loss-scale", "1"])) == (
        "tp_nvfp4_s0"
    )
    # LOSS_SCALE_SUFFIX finds the part these names add, last before the seed
    from fp4_train.experiments.records import run_stem

    unscaled = {tp_train.run_name(small): "tp_tahquant-grad", named: "tp_nvfp4"}
    for name, config in unscaled.items():
        assert tp_train.LOSS_SCALE_SUFFIX.sub("", run_stem(name)) == config


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch", "0"], "--batch 0: at least 1"),
        (["--seq-len", "-1"], "--seq-len -1: at least 1"),
        (["--d-model", "0"], "--d-model 0: at least 1"),
        (["--steps", "0"], "--steps 0: at least 1"),
        (["--eval-batches", "0"], "--eval-batches 0: at least 1"),
        (["--threads", "0"], "--threads 0: at least 1"),
        (["--ffn", "0"], "--ffn 0: at least 1"),
        (["--kv-heads", "0"], "--kv-heads 0: at least 1"),
        (["--max-bytes", "0"], "--max-bytes 0: at least 1"),
        (["--warmup", "-5"], "--warmup -5: at least 0"),
        (["--eval-every", "-1"], "--eval-every -1: at least 0"),
        (["--stats-every", "-1"], "--stats-every -1: at least 0"),
        (["--lr", "nan"], "--lr nan: a finite number >= 0"),
        (["--lr", "-1"], "--lr -1.0: a finite number >= 0"),
        (["--lr", "inf"], "--lr inf: a finite number >= 0"),
        (["--val-fraction", "1.5"], "--val-fraction 1.5: between 0 and 1"),
        (["--val-fraction", "0"], "--val-fraction 0.0: between 0 and 1"),
        (["--seed", "-1"], "--seed -1: in [0, 2**32)"),
        (["--seed", "99999999999999"], "--seed 99999999999999: in [0, 2**32)"),
        (["--parallel", "pp", "--batch", "16", "--microbatches", "3"],
         "--microbatches 3: must divide --batch 16"),
        (["--parallel", "pp", "--sequence-parallel"], "not with --parallel pp"),
        (["--data-format", "tokens", "--data", "a", "b"], "--data-format tokens: one --data"),
        (["--d-model", "30", "--heads", "4"], "--d-model 30: a multiple of --heads 4"),
        (["--codec", "fp4quant-g3"], "argument --codec: FP4Quant.group_size: 3"),
        (["--codec", "fp4quant", "--group-size", "100"], "--group-size 100:"),
        (["--graph-cache-gb", "inf"], "--graph-cache-gb inf: a finite number"),
        (["--model", "qwen", "--d-model", "30", "--heads", "2"],
         "--d-model 30: a multiple of 2 x --heads 2"),
        (["--model", "qwen", "--heads", "4", "--kv-heads", "3"], "--kv-heads 3: must divide"),
        (["--parallel", "pp", "--codec", "native"], "--codec native / --grad-codec native:"),
        (["--parallel", "pp", "--codec", "nvfp4", "--grad-codec", "native"],
         "--codec native / --grad-codec native:"),
        (["--parallel", "pp", "--codec", "nvfp4", "--error-feedback"],
         "--error-feedback / --grad-error-feedback correct sums"),
        (["--data-format", "random", "--vocab", "300"], "--vocab 300: --model byte has a byte"),
        # TAH-Quant rounds to nearest only: stochastic asked for, by default (the residual
        # stream's gradient) or kept by an evaluation
        (["--codec", "tahquant-h256", "--rounding", "stochastic"],
         "--rounding stochastic: tahquant-h256 rounds to nearest only; pass --rounding nearest"),
        (["--parallel", "pp", "--codec", "tahquant-h256", "--grad-codec", "tahquant-grad"],
         "--grad-rounding stochastic (the default for the residual stream's gradient): "
         "tahquant-grad rounds to nearest only; pass --grad-rounding nearest"),
        (["--sequence-parallel", "--codec", "nvfp4", "--grad-codec", "tahquant-grad"],
         "--grad-rounding stochastic (the default"),
        (["--codec", "nvfp4", "--rounding", "stochastic", "--grad-codec", "tahquant-grad"],
         "--grad-rounding stochastic (--rounding's, the default): tahquant-grad rounds to"),
        (["--codec", "nvfp4", "--grad-codec", "tahquant-grad", "--grad-rounding", "stochastic"],
         "--grad-rounding stochastic: tahquant-grad rounds to nearest only"),
        (["--codec", "nvfp4", "--rounding", "stochastic", "--eval-codecs", "tahquant-h256"],
         "--eval-codecs tahquant-h256: rounds to nearest only, and an evaluation keeps the "
         "run's --rounding stochastic"),
    ],
)  # fmt: skip
def test_run_arguments_out_of_range_are_named(argv, message, capsys):
    """Sizes, counts, rates and combinations that trained to NaN, scaled the gradient (micro-
    batches that do not divide the batch), were silently reinterpreted (a negative
    --eval-every evaluated every step) or failed deep inside a run."""
    from fp4_train.experiments import tp_train

    with pytest.raises(SystemExit):
        tp_train.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--layers", "--d-model", "--heads", "--kv-heads", "--ffn"])
def test_a_qwen_preset_refuses_the_sizes_it_fixes(option, capsys):
    """A --model qwen-<size> preset fixes the model's sizes: a given one (even the default's
    value) was silently ignored; it is named.  The defaults recorded in the run's arguments
    stay as they were, with a preset too."""
    from fp4_train.experiments import emulated_tp, tp_train

    value = "64" if option == "--d-model" else "2"
    for parse in (tp_train.parse_args, emulated_tp.parse_args):
        with pytest.raises(SystemExit):
            parse(["--model", "qwen-tiny", option, value])
        assert f"{option}: --model qwen-tiny is a preset of fixed sizes" in capsys.readouterr().err
    for model in ("byte", "qwen", "qwen-tiny"):
        args = tp_train.parse_args(["--model", model])
        assert (args.layers, args.d_model, args.heads) == (4, 256, 4)
    args = tp_train.parse_args(["--model", "qwen", option, value])
    assert getattr(args, option[2:].replace("-", "_")) == int(value)


@pytest.mark.parametrize("option", ["--kv-heads", "--ffn"])
def test_the_byte_model_refuses_qwen_sizes(option, capsys):
    """--model byte has no grouped-query heads and a 4 x d MLP: --kv-heads / --ffn given to it
    were silently ignored; they are named."""
    from fp4_train.experiments import tp_train

    with pytest.raises(SystemExit):
        tp_train.parse_args(["--model", "byte", option, "2"])
    assert f"{option}: qwen sizes; --model byte" in capsys.readouterr().err


def test_out_and_checkpoint_paths_are_checked_before_the_run(tmp_path, capsys):
    from fp4_train.experiments import tp_train

    (tmp_path / "afile").write_text("x")
    for argv, message in (
        (["--out", str(tmp_path / "afile")], "exists and is not a folder"),
        (["--out", str(tmp_path / "afile" / "sub")], "is not a folder"),
        (["--checkpoint", str(tmp_path / "afile" / "x.pt")], "is not a folder"),
    ):
        with pytest.raises(SystemExit):
            tp_train.parse_args(argv)
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        (["--heads", "2"], 3, "--heads (2): must divide by the 3 processes"),
        (["--model", "qwen", "--heads", "4", "--kv-heads", "2"], 4, "--kv-heads (2): must"),
        (["--model", "qwen", "--ffn", "102"], 4, "--ffn (102): must divide by the 4"),
        (["--model", "qwen-tiny"], 3, "heads of --model qwen-tiny (4): must divide by the 3"),
        (["--sequence-parallel", "--seq-len", "9"], 2, "--seq-len 9: a multiple of the 2"),
        (["--parallel", "pp"], 3, "--parallel pp: two pipeline stages, one a rank; not the 3"),
    ],
)  # fmt: skip
def test_a_model_that_does_not_split_over_the_ranks_is_named(argv, world, message, capsys,
                                                              monkeypatch):  # fmt: skip
    """Heads and widths that the ranks cannot split equally, refused with the option named
    before the corpus is read and the process group made (they failed inside the model's
    construction, with a traceback on every rank)."""
    import fp4_comm
    from fp4_train.experiments import tp_train

    def no_group(*args, **kwargs):
        raise AssertionError("the process group was made")

    monkeypatch.setattr(fp4_comm.Communicator, "from_env", no_group)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit):
        tp_train.main(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err
    tp_train.parse_args(["--device", "cpu", *argv])  # the arguments themselves are valid


def test_byte_model_refuses_a_token_vocabulary(monkeypatch):
    import torch

    from fp4_train.experiments import tp_train

    def tokens(args):
        ids = torch.arange(4096) % 1000
        return ids[:3000], ids[3000:], 1000

    monkeypatch.setitem(tp_train.DATA_FORMATS, "tokens", tokens)
    args = tp_train.parse_args(["--data-format", "tokens", "--seq-len", "16"])
    with pytest.raises(SystemExit, match="gives a vocabulary of 1000; --model byte has a byte"):
        tp_train.load_data(args)
    args = tp_train.parse_args(["--data-format", "tokens", "--seq-len", "16", "--model", "qwen"])
    assert tp_train.load_data(args)[2] == 1000


def test_a_corpus_too_small_or_unreadable_is_named(tmp_path):
    from fp4_train.experiments import tp_train

    small = tmp_path / "small.txt"
    small.write_text("twenty bytes of text")
    args = tp_train.parse_args(["--data", str(small), "--seq-len", "64"])
    with pytest.raises(SystemExit, match="its training split holds 18 tokens, fewer than "):
        tp_train.load_data(args)
    bad = tmp_path / "bad.gz"
    bad.write_bytes(b"not gzip at all")
    args = tp_train.parse_args(["--data", str(bad)])
    with pytest.raises(SystemExit, match="--data .*bad.gz: cannot be read as --data-format bytes"):
        tp_train.load_data(args)


def test_summary_names_a_record_without_what_its_tables_read(tmp_path):
    """tp_summary over a folder holding a tp_train record that lacks a field: the file and the
    field named, not a KeyError; other JSON left out."""
    import json

    from fp4_train.experiments import tp_summary

    (tmp_path / "other.json").write_text("[1, 2]")
    (tmp_path / "a.json").write_text(json.dumps({"summary": {}, "steps": [], "name": "a"}))
    with pytest.raises(SystemExit, match="a.json: a tp_train record without codec, config, "
                                         "evals, world_size, config.parallel"):  # fmt: skip
        tp_summary.main([str(tmp_path)])
    (tmp_path / "a.json").unlink()
    with pytest.raises(SystemExit, match="no tp_train records"):
        tp_summary.main([str(tmp_path)])


def test_tp_train_outside_torchrun_says_how_to_run_it(monkeypatch):
    from fp4_train.experiments import tp_train

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="tp_train runs one rank a process, under torchrun"):
        tp_train.main(["--device", "cpu"])


def test_emulated_arguments_are_named(capsys):
    from fp4_train.experiments import emulated_tp

    for argv, message in (
        (["--name", "myrun"], "--name: emulated runs are named from their configuration"),
        (["--seeds", "0", "0"], "--seeds 0 0: a seed given twice"),
        (["--seeds", "-1"], "--seeds: -1 is not in [0, 2**32)"),
        (["--tokens-per-step", "0"], "--tokens-per-step 0: a positive multiple"),
        (["--parallel", "pp", "--tokens-per-step", "3072", "--microbatches", "2"],
         "--microbatches 2: must divide --batch 3"),
        (["--sequence-parallel", "--seq-len", "15", "--tp", "2"], "--seq-len 15: a multiple"),
        (["--tp", "3", "--heads", "2"], "--heads (2): must divide by --tp 3"),
        (["--tp", "2", "--model", "qwen", "--heads", "4", "--kv-heads", "1"],
         "--kv-heads (1): must divide by --tp 2"),
        (["--tp", "8", "--model", "qwen-tiny"], "of --model qwen-tiny"),
    ):  # fmt: skip
        with pytest.raises(SystemExit):
            emulated_tp.parse_args(argv)
        assert message in capsys.readouterr().err, argv


def test_a_diverged_runs_record_is_written_with_null_losses(tmp_path):
    from fp4_train.experiments import records

    records.write_json(tmp_path / "r.json", {"loss": float("nan"), "curve": [[0, float("inf")]]})
    assert json.loads((tmp_path / "r.json").read_text()) == {"loss": None, "curve": [[0, None]]}


def test_late_gap_of_short_runs():
    from fp4_train.experiments.tp_summary import late_gap

    run = {"steps": [{"loss": 2.0}, {"loss": 1.5}, {"loss": 1.0}]}
    base = {"steps": [{"loss": 2.0}, {"loss": 1.5}, {"loss": 0.5}]}
    assert late_gap(run, base) == 0.5  # the last step (a fifth of 3 steps is none)
    assert late_gap({"steps": []}, base) is None


def _exit_on_rank_one(rank):
    if rank == 1:
        os._exit(3)  # no answer, no traceback: as a crash inside a library ends a rank
    return rank


def test_a_rank_that_dies_without_an_answer_fails_the_test_at_once():
    """The harness itself: a spawned rank that ends without an answer is a RuntimeError as
    soon as it is gone, not a wait for the time limit."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="a test worker died without an answer"):
        spawn(2, _exit_on_rank_one, minutes=5)
    assert time.monotonic() - start < 120
