"""fp4_train.experiments.emulated_tp: k tensor-parallel ranks (or the two pipeline stages)
emulated in one process train the same model as k gloo processes running ``tp_train``, bit for
bit: every rank's loss at every step and every rank's weights after the last one (its shards,
and under SP its replicas), with an evaluation between steps (its collectives count towards
the stochastic-rounding steps too).  Tensor parallelism with 2 and 3 ranks, the Qwen2-style
decoder (grouped-query attention with 12 query and 6 key/value heads, so both split) and the
byte-level transformer, NVFP4 with stochastic rounding and error feedback both ways, FP4Quant
forward with a bf16 gradient, TAH-Quant (its activation and gradient codecs), MXFP4 (fused
sum) under bfloat16 autocast, sequence parallelism (the residual stream's gradient
stochastic), the pipeline with two micro-batches, and a static loss scale (TAH-Quant in TP,
NVFP4 in the pipeline; on an FP4 or bf16 wire a power-of-two scale changes no bit).  Codec
"native": with 2 ranks and float32 one add, so the same bits; with 3 ranks gloo's own order,
within float32 rounding.  Then the driver end to end (``tp_train.train`` against
``emulated_tp.run``) and its compact summary.
"""

from __future__ import annotations

import datetime
import json
import math
import os

import numpy as np
import pytest
import torch
from _processes import spawn, write_corpus

pytest.importorskip("fp4_comm")

from fp4_train.experiments.corpus import CI_SLICE  # noqa: E402

WORLD = 3
STEPS = 3
QWEN = ["--model", "qwen", "--layers", "2", "--d-model", "96", "--heads", "12",
        "--kv-heads", "6", "--ffn", "96"]  # fmt: skip
BASE = ["--device", "cpu", "--seq-len", "24", "--batch", "4", "--lr", "3e-3", "--steps",
        str(STEPS), "--eval-every", "0", "--eval-batches", "2", "--timing-warmup", "0",
        "--stats-every", "1", "--quiet", "--seed", "3"]  # fmt: skip
NVFP4_SR_EF = ["--codec", "nvfp4", "--rounding", "stochastic", "--error-feedback"]
PP_EXACT_BF16 = ["--codec", "none-float32", "--parallel", "pp", "--dtype", "bfloat16"]
PP_NVFP4 = ["--codec", "nvfp4", "--parallel", "pp", "--microbatches", "2"]
# TAH-Quant: tokens of the model's width (128, two tiles of 64), its gradient codec back
TAHQUANT = ["--model", "qwen", "--layers", "2", "--d-model", "128", "--heads", "4",
            "--kv-heads", "2", "--ffn", "128", "--codec", "tahquant-h128",
            "--grad-codec", "tahquant-grad"]  # fmt: skip
LOSS_SCALE = ["--loss-scale", "65536"]
# (id, world, arguments)
CONFIGS = [
    ("tp2-nvfp4-sr-ef", 2, [*QWEN, *NVFP4_SR_EF]),
    ("tp3-nvfp4-sr-ef", 3, [*QWEN, *NVFP4_SR_EF]),
    ("tp3-g64-fwd", 3, [*QWEN, "--codec", "fp4quant-g64", "--grad-codec", "none"]),
    ("tp2-mxfp4-bf16", 2, [*QWEN, "--codec", "mxfp4", "--dtype", "bfloat16"]),
    ("sp3-g64", 3, [*QWEN, "--codec", "fp4quant-g64", "--sequence-parallel"]),
    ("pp-nvfp4", 2, [*QWEN, *PP_NVFP4]),
    # the exact boundary under autocast: float32 crosses, not the bf16 compute dtype
    ("pp-fp32-bf16", 2, [*QWEN, *PP_EXACT_BF16, "--microbatches", "2"]),
    ("byte-tp2-nvfp4", 2, ["--layers", "2", "--d-model", "32", "--heads", "2", *NVFP4_SR_EF]),
    ("tp2-tahquant", 2, TAHQUANT),
    # a loss scale: the gradients on the wire S times larger, divided by S before the step
    ("tp2-tahquant-ls", 2, [*TAHQUANT, *LOSS_SCALE]),
    ("pp-nvfp4-ls", 2, [*QWEN, *PP_NVFP4, *LOSS_SCALE]),
    ("tp2-native", 2, [*QWEN, "--codec", "native"]),
    ("tp3-native", 3, [*QWEN, "--codec", "native"]),
]
EXACT = [c[0] for c in CONFIGS if c[0] != "tp3-native"]
# the driver end to end: tp_train.train against emulated_tp.run, on the BPE corpus's CI slice
# (a 16 384-token vocabulary)
TOKENS = ["--data-format", "tokens", "--data", str(CI_SLICE)]
END_TO_END = ("tp2-e2e", 2, [*QWEN, *NVFP4_SR_EF, "--eval-every", "2", *TOKENS])


def _bits(t):
    t = t.detach().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().copy()


def _steps(runner, args, steps=STEPS):
    """``steps`` training steps with an evaluation after the first: each step's per-rank
    losses, the evaluation's, and the weights."""
    from fp4_train.experiments import tp_train
    from fp4_train.experiments.corpus import train_batch, val_batches

    train_tokens, val_tokens, _ = tp_train.load_data(args)
    val = val_batches(val_tokens, args.eval_batches, args.batch, args.seq_len)
    losses = []
    for step in range(steps):
        x, y = train_batch(train_tokens, step, args.batch, args.seq_len, args.seed)
        x, y = x.to(runner.device), y.to(runner.device)
        log_stats = args.stats_every > 0  # (statistics make a collective eager: no graphs)
        losses.append(runner.rank_values(runner.step(x, y, log_stats=log_stats)))
        if step == 0:
            losses.append(["eval", runner.evaluate(val)])
    return losses, {k: _bits(v.cpu()) for k, v in runner.model.state_dict().items()}


def _worker(rank, corpus):
    import torch.distributed as dist

    import fp4_comm
    from fp4_train.experiments import tp_train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    comms = {3: fp4_comm.Communicator.from_process_group(None, "cpu", 120.0, "first")}
    pair = dist.new_group([0, 1])  # every rank takes part in making it
    comms[2] = (fp4_comm.Communicator.from_process_group(pair, "cpu", 120.0, "first")
                if rank < 2 else None)  # fmt: skip
    res = {}
    for name, world, argv in CONFIGS:
        comm = comms[world]
        if comm is None:
            continue
        comm.error_feedback.reset()
        comm._calls = comm._sends = 0  # each run as a fresh communicator counts
        args = tp_train.parse_args([*BASE, *argv, "--data", str(corpus)])
        runner = tp_train.Runner(args, comm, torch.device("cpu"), 256)
        res[name] = _steps(runner, args)
    name, world, argv = END_TO_END
    if rank < world:
        comms[world].error_feedback.reset()
        comms[world]._calls = comms[world]._sends = 0
        args = tp_train.parse_args([*BASE, *argv])
        record = tp_train.train(args, comms[world])
        res[name] = {"losses": [s["loss"] for s in record["steps"]],
                     "evals": record["evals"],
                     "final_evals": record["summary"]["final_evals"]}  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    return res


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("emulated_tp") / "corpus.txt")


@pytest.fixture(scope="module")
def real(corpus):
    """The gloo processes' results, by rank."""
    return spawn(WORLD, _worker, corpus)


def _emulated(name, corpus, configs=CONFIGS, device="cpu", world=None, steps=STEPS):
    config = next(c for c in configs if c[0] == name)
    world = config[1] if world is None else world
    args, runner = _emulated_runner(config[-1], corpus, world, device)
    return world, args, _steps(runner, args, steps)


def _emulated_runner(argv, corpus, world, device="cpu"):
    """The arguments ``BASE + argv`` on ``corpus`` and the emulated runner of ``world`` ranks."""
    from fp4_train.experiments import emulated_tp, tp_train

    args = tp_train.parse_args([*BASE, *argv, "--data", str(corpus)])
    # as tp_train.train sets it (and the workers): CPU kernels may split sums by thread
    torch.set_num_threads(args.threads)
    return args, emulated_tp.EmulatedRunner(args, torch.device(device), 256, world)


def test_error_feedback_sizes_the_emulated_ranks_graph_cache():
    """The emulated ranks' group graphs: with error feedback a graph per call site, so the
    cache is ``tp_train.graph_cache_bounds``'s, not fp4_comm's default."""
    from fp4_train.experiments import emulated_tp, tp_train

    args = tp_train.parse_args([*BASE, *NVFP4_SR_EF])
    runner = emulated_tp.EmulatedRunner(args, torch.device("cpu"), 256, 2)
    cache = runner.ranks._graphed
    assert (cache.max_graphs, cache.max_bytes) == tp_train.graph_cache_bounds(args)
    assert cache.max_bytes == int(tp_train.EF_GRAPH_CACHE_GB * 2**30)


def _rank_state(emulated_state, rank, pp):
    """Rank ``rank``'s weights as that rank names them, from the emulated model's: rank r's
    shard (or SP replica) of "x.w" is "x.w.<r>"; a replicated weight is every rank's; in the
    pipeline stage s's weights are "<s>.<name>"."""
    mine = {}
    for key, value in emulated_state.items():
        if pp:
            stage, _, rest = key.partition(".")
            if int(stage) == rank:
                mine[rest] = value
            continue
        stem, _, last = key.rpartition(".")
        if last.isdigit():
            if int(last) == rank:
                mine[stem] = value
        else:
            mine[key] = value
    return mine


@pytest.mark.parametrize("name", EXACT)
def test_emulated_training_equals_the_processes(real, corpus, name):
    _assert_equal(real, name, *_emulated(name, corpus))


def _assert_equal(real, name, world, args, emulated):
    losses, state = emulated
    pp = args.parallel == "pp"
    for r in range(world):
        real_losses, real_state = real[r][name]
        assert len(real_losses) == len(losses) == STEPS + 1
        for step, (a, b) in enumerate(zip(real_losses, losses, strict=True)):
            # equal NaNs would compare unequal here and hide what is wrong: a loss that is not
            # finite fails on its own, naming the side
            for side, record in (("real", a), ("emulated", b)):
                values = [v for v in record if not isinstance(v, str)]
                assert all(math.isfinite(v) for v in values), (side, r, step, record)
            if a[0] == "eval":
                assert a == b, (r, step)  # the mean every rank reports
            elif pp:
                if r == 1:  # the last stage has the loss
                    assert a == b, (r, step)
            else:
                # per rank (under SP each rank's own; else one value, every rank's)
                assert a[0] == (b[r] if len(b) > 1 else b[0]), (r, step, a, b)
        mine = _rank_state(state, r, pp)
        assert sorted(mine) == sorted(real_state), r
        for key, bits in real_state.items():
            assert np.array_equal(bits, mine[key]), (r, key)


# wires whose codecs are equivariant under a power-of-two scale: every scale format (E4M3
# under a float32 tensor scale, E8M0, bfloat16) holds the scaled gradients, so a loss scale
# changes no bit (stochastic rounding and error feedback included); and bf16 values
EQUIVARIANT = [c for c in CONFIGS if c[0] in ("tp2-nvfp4-sr-ef", "tp2-mxfp4-bf16", "sp3-g64",
                                              "pp-nvfp4")] + [
    ("tp2-bf16-wire", 2, [*QWEN, "--codec", "none", "--dtype", "bfloat16"])]  # fmt: skip


@pytest.mark.parametrize("name", [c[0] for c in EQUIVARIANT])
def test_a_loss_scale_changes_no_bit_of_an_fp4_or_bf16_wire(corpus, name):
    """``--loss-scale 65536`` against none: the same losses and weights, bit for bit; and the
    backward payloads on the wire are 65536 times larger (their RMS in the statistics)."""
    config = next(c for c in EQUIVARIANT if c[0] == name)
    scaled = [(name, config[1], [*config[2], *LOSS_SCALE])]
    _, _, (plain_losses, plain_state) = _emulated(name, corpus, EQUIVARIANT, steps=2)
    world, _, (losses, state) = _emulated(name, corpus, scaled, steps=2)
    assert losses == plain_losses
    assert sorted(state) == sorted(plain_state)
    for key, bits in plain_state.items():
        assert np.array_equal(bits, state[key]), key
    # the statistics of a step: the backward payloads scaled, the forward ones not
    ratios = _wire_rms_ratios(corpus, world, config[2], scaled[0][2])
    assert math.isclose(ratios["backward"], 65536.0, rel_tol=1e-5), ratios
    assert math.isclose(ratios["forward"], 1.0, rel_tol=1e-6), ratios


def _wire_rms_ratios(corpus, world, plain, scaled):
    """Per direction, the payloads' mean RMS in the first step's statistics of the run with
    arguments ``scaled`` over that of the run with ``plain``."""
    from fp4_train.experiments import tp_train
    from fp4_train.experiments.corpus import train_batch

    rms = []
    for argv in (plain, scaled):
        args, runner = _emulated_runner(argv, corpus, world)
        train_tokens, _, _ = tp_train.load_data(args)
        x, y = train_batch(train_tokens, 0, args.batch, args.seq_len, args.seed)
        runner.step(x, y, log_stats=True)
        by_direction = {}
        for w in runner.wire_stats():
            by_direction.setdefault(w["direction"], []).append(w["rms"])
        rms.append({d: sum(v) / len(v) for d, v in by_direction.items()})
    return {d: rms[1][d] / rms[0][d] for d in rms[0]}


def test_a_loss_scale_lifts_tahquant_gradients_on_the_wire(corpus):
    """TAH-Quant's gradient codec has fp16 scales, so its bits do change with a loss scale:
    the run with it differs from the run without, with backward payloads 65536 times larger
    on the wire (the equality of either with the gloo processes: the CONFIGS above)."""
    _, _, (plain_losses, plain_state) = _emulated("tp2-tahquant", corpus, steps=2)
    _, _, (losses, state) = _emulated("tp2-tahquant-ls", corpus, steps=2)
    assert losses[0] == plain_losses[0]  # the first forward pass has nothing scaled
    assert any(not np.array_equal(plain_state[k], state[k]) for k in plain_state)
    ratios = _wire_rms_ratios(corpus, 2, TAHQUANT, [*TAHQUANT, *LOSS_SCALE])
    assert math.isclose(ratios["backward"], 65536.0, rel_tol=1e-2), ratios


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_exact_boundary_splits_the_plain_model_bit_for_bit(corpus, device):
    """Under bf16 autocast the residual stream is float32 inside the model (block outputs
    are added to float32 activations), so the pipeline with the exact boundary (float32
    crosses) and one micro-batch computes what the whole model does: every loss, the
    evaluation and every weight, bit for bit.  With ``none`` the boundary rounds the residual
    stream to bf16, which the plain model never does: the losses part at once."""
    from fp4_train.experiments import emulated_tp, tp_train

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")

    def train(*extra):
        args = tp_train.parse_args([*BASE, *QWEN, "--dtype", "bfloat16", "--microbatches",
                                    "1", "--data", str(corpus), *extra])  # fmt: skip
        torch.set_num_threads(args.threads)
        runner = emulated_tp.make_runner(1)(args, torch.device(device), 256)
        with _deterministic():
            return _steps(runner, args)

    plain_losses, plain_state = train("--codec", "none")
    losses, state = train(*PP_EXACT_BF16)
    assert all(math.isfinite(v[-1]) for v in plain_losses), plain_losses
    assert [v[-1] for v in losses] == [v[-1] for v in plain_losses]
    # "<stage>.<name>"; stage 1 numbers its blocks from 0, the plain model's from layers / 2
    half = int(QWEN[QWEN.index("--layers") + 1]) // 2
    split = {}
    for key, value in state.items():
        stage, _, name = key.partition(".")
        if stage == "1" and name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            name = f"blocks.{int(i) + half}.{rest}"
        split[name] = value
    assert sorted(split) == sorted(plain_state)
    for key, bits in plain_state.items():
        assert np.array_equal(bits, split[key]), key
    rounded, _ = train("--codec", "none", "--parallel", "pp")
    assert rounded[0][-1] != plain_losses[0][-1]


def test_native_with_three_ranks_is_within_float32_rounding(real, corpus):
    """gloo's all-reduce of 3 float32 tensors adds in an order of its own; the emulation in
    rank order.  The losses agree to float32 rounding carried over 3 steps (not bit for bit)."""
    world, _, (losses, _) = _emulated("tp3-native", corpus)
    real_losses = real[0]["tp3-native"][0]
    for a, b in zip(real_losses, losses, strict=True):
        va, vb = (a[1], b[1]) if a[0] == "eval" else (a[0], b[0])
        assert abs(va - vb) <= 1e-4 * abs(va), (a, b)


def test_the_driver_end_to_end(real, tmp_path):
    """``emulated_tp.main`` against ``tp_train.train`` on 2 processes, on BPE tokens: the same
    per-step losses, evaluations (every 2 steps and after the last) and final evaluations with
    an exact forward wire; the compact summary has what the table needs and is small."""
    from fp4_train.experiments import emulated_tp

    _, world, argv = END_TO_END
    out = tmp_path / "runs"
    (summary,) = emulated_tp.main(
        [*BASE, *argv, "--tp", str(world), "--out", str(out), "--curve-points", "2"]
    )
    mine = real[0][END_TO_END[0]]
    assert [loss for _, loss in summary["train_loss_curve"]] == pytest.approx(
        [sum(mine["losses"][:2]) / 2, mine["losses"][2]], abs=0
    )
    assert summary["evals"] == [[e["step"], e["val_loss"]] for e in mine["evals"]]
    assert summary["final_evals"] == mine["final_evals"]
    assert summary["final_val_loss"] == mine["evals"][-1]["val_loss"]
    path = out / "qwen_tp2_nvfp4_sr_ef_s3.json"
    assert summary["name"] == path.stem and path.stat().st_size < 20_000
    saved = json.loads(path.read_text())
    assert saved["kind"] == "emulated_tp_summary" and saved["layout"] == "tp2"
    assert saved["tokens_per_s"] > 0 and saved["wall_s"] > 0 and saved["vocab"] == 16384
    assert {(w["site"], w["direction"]) for w in saved["wire"]} == {
        ("enter", "backward"), ("exit", "forward")}  # fmt: skip
    assert all(math.isfinite(w["sqnr_db"]) for w in saved["wire"])
    # a second call skips the run whose summary exists
    assert emulated_tp.main([*BASE, *argv, "--tp", "2", "--out", str(out)]) == []


# ------------------------------------------------------------------ NCCL, ranks on one GPU

QWEN_GPU = ["--model", "qwen", "--layers", "2", "--d-model", "64", "--heads", "8",
            "--kv-heads", "4", "--ffn", "128"]  # fmt: skip
GPU_CONFIGS = [
    ("gpu-tp-nvfp4-sr-ef", [*QWEN_GPU, *NVFP4_SR_EF]),
    ("gpu-tp-g64-fwd", [*QWEN_GPU, "--codec", "fp4quant-g64", "--grad-codec", "none"]),
    ("gpu-tp-mxfp4", [*QWEN_GPU, "--codec", "mxfp4"]),  # the fused sum's kernel
    ("gpu-sp-g64", [*QWEN_GPU, "--codec", "fp4quant-g64", "--sequence-parallel"]),
    ("gpu-pp-nvfp4", [*QWEN_GPU, *PP_NVFP4]),
    ("gpu-pp-fp32-bf16", [*QWEN_GPU, *PP_EXACT_BF16, "--microbatches", "2"]),
    # no statistics: the training steps' collectives replay CUDA graphs (the NCCL ranks' own,
    # the emulated group's), forward and backward
    (
        "gpu-tp-g64-graphs",
        [*QWEN_GPU, "--codec", "fp4quant-g64", "--grad-codec", "none", "--stats-every", "0"],
    ),
    ("gpu-tp-nvfp4-graphs", [*QWEN_GPU, "--codec", "nvfp4", "--stats-every", "0"]),
    # TAH-Quant's kernels (the entropy pass, its activation and gradient codecs) on tokens of
    # 128 channels, two tiles of 64
    ("gpu-tp-tahquant", ["--model", "qwen", "--layers", "2", "--d-model", "128", "--heads", "8",
                         "--kv-heads", "4", "--ffn", "128", "--codec", "tahquant-h128",
                         "--grad-codec", "tahquant-grad"]),
    # a loss scale (the gradients on the wire 65536 times larger), TP and the pipeline
    ("gpu-tp-tahquant-ls", ["--model", "qwen", "--layers", "2", "--d-model", "128", "--heads",
                            "8", "--kv-heads", "4", "--ffn", "128", "--codec", "tahquant-h128",
                            "--grad-codec", "tahquant-grad", *LOSS_SCALE]),
    ("gpu-pp-nvfp4-ls", [*QWEN_GPU, *PP_NVFP4, *LOSS_SCALE]),
]  # fmt: skip
NATIVE_STEPS = 20
GPU_NATIVE = ("gpu-tp-native", [*QWEN_GPU, "--codec", "native"])
NCCL_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            # cuBLAS picks reproducible reductions with a fixed workspace
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # fmt: skip


def _gpu_world():
    return int(os.environ.get("FP4_COMM_TEST_RANKS", "2"))


def _gpu_configs(world):
    return [c for c in GPU_CONFIGS if "--parallel" not in c[1] or world == 2]


def _deterministic():
    """Deterministic kernels and the math attention (its backward has no atomics), in the
    processes and in the emulation alike: bit-identity needs the same arithmetic run twice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.use_deterministic_algorithms(True, warn_only=True)
    return sdpa_kernel([SDPBackend.MATH])


def _native_sums(world, seed=0):
    """bfloat16 tensors of the ranks, for NCCL's own all-reduce."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(37, 64, generator=g) * 4).to(torch.bfloat16) for _ in range(world)]


def _gpu_worker(rank, world, corpus):
    import torch.distributed as dist

    import fp4_comm
    from fp4_train.experiments import tp_train

    device = fp4_comm.local_device(rank)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    comm = fp4_comm.Communicator.from_process_group(None, device, 300.0, "first")
    res = {}
    with _deterministic():
        for name, argv in [*_gpu_configs(world), GPU_NATIVE]:
            comm.error_feedback.reset()
            comm._calls = comm._sends = 0
            args = tp_train.parse_args([*BASE, *argv, "--device", "cuda", "--data",
                                        str(corpus)])  # fmt: skip
            runner = tp_train.Runner(args, comm, device, 256)
            steps = NATIVE_STEPS if name == GPU_NATIVE[0] else STEPS
            res[name] = _steps(runner, args, steps)
        # NCCL's own all-reduce of bf16 values (the native group the last run made)
        y = _native_sums(world)[rank].to(device)
        dist.all_reduce(y, group=runner.par.native_group)
        # numpy, not a tensor: a CPU tensor crosses the pipe as a handle to this process's
        # memory, which is gone once it exits
        res["native_sum"] = y.float().cpu().numpy()
    comm.close()
    dist.barrier()
    dist.destroy_process_group()
    return res


@pytest.fixture(scope="module")
def real_gpu(corpus):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    from fp4_comm.devices import sharing_problem

    try:
        problem = sharing_problem(_gpu_world())
    except ImportError as err:  # no CuPy with NCCL
        pytest.skip(str(err))
    if problem is not None:  # NCCL too old to share a GPU between ranks
        pytest.skip(problem)
    return spawn(_gpu_world(), _gpu_worker, _gpu_world(), corpus, minutes=15)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [c[0] for c in GPU_CONFIGS])
def test_emulated_training_equals_nccl_ranks_on_one_gpu(real_gpu, corpus, name):
    """FP4_COMM_TEST_RANKS NCCL ranks (default 2; 4 too) sharing the GPU against the emulation
    on the same GPU: every loss and weight, bit for bit (the pipeline: with 2 ranks)."""
    world = _gpu_world()
    if name not in dict(_gpu_configs(world)):
        pytest.skip("the pipeline has two stages: FP4_COMM_TEST_RANKS=2")
    with _deterministic():
        emulated = _emulated(name, corpus, GPU_CONFIGS, "cuda", world)
    _assert_equal(real_gpu, name, *emulated)


@pytest.mark.gpu
def test_bf16_baseline_tracks_nccl_native(real_gpu, corpus):
    """NCCL's own bf16 all-reduce against the emulated baseline, a float32 sum in rank order
    rounded to bf16.  One all-reduce: every element within the bound of any summation order
    that rounds each partial sum to bf16 (k - 1 roundings, each at most 2^-8 of the sum of the
    magnitudes S, and ours one: k 2^-8 S).  Training: NATIVE_STEPS steps of the tiny model,
    each loss within 1 % of NCCL's (the differences are bf16 roundings carried along)."""
    from fp4_comm import reference

    world = _gpu_world()
    xs = _native_sums(world)
    ours = reference.all_reduce([x.cuda() for x in xs], codec="none-float32")[0].float().cpu()
    bound = world * 2.0**-8 * sum(x.float().abs() for x in xs)
    for r in range(world):
        assert torch.all((torch.from_numpy(real_gpu[r]["native_sum"]) - ours).abs() <= bound)
    with _deterministic():
        _, _, (losses, _) = _emulated(GPU_NATIVE[0], corpus, [GPU_NATIVE], "cuda", world,
                                      NATIVE_STEPS)  # fmt: skip
    nccl = real_gpu[0][GPU_NATIVE[0]][0]
    for side, records in (("nccl", nccl), ("emulated", losses)):
        assert all(math.isfinite(r[-1]) for r in records), (side, records)
    rel = [abs(a[-1] - b[-1]) / abs(a[-1]) for a, b in zip(nccl, losses, strict=True)]
    print(f"native vs emulated bf16 baseline, {world} ranks: largest relative loss difference "
          f"over {NATIVE_STEPS} steps {max(rel):.2e}")  # fmt: skip
    assert max(rel) < 1e-2
