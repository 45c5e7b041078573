"""fp4_train.experiments.tp_train on the GPU path (``gpu``): torchrun with
``FP4_COMM_TEST_RANKS`` ranks (default 2; more ranks than GPUs share them in NCCL's multi-rank
mode, NCCL >= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``), 20 steps of each GPU-only
configuration: the pipeline's backward send over NCCL (two stages: with 2 ranks), codec
``native`` (torch.distributed's NCCL group) captured in a CUDA graph, sequence parallelism,
NVFP4 with error feedback.  Each must train (finite losses that fall) and write its record;
tensor parallelism with exact float32 communication must match a one-process run on the same
GPU as closely as the CPU test's reordering bound says."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from _processes import write_corpus

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("fp4_comm")

STEPS = 20
EXACT_STEPS = 4
LAYERS, D_MODEL = 2, 64
# float32 unit roundoff
U32 = 2.0**-24
TINY = ["--device", "cuda", "--layers", str(LAYERS), "--d-model", str(D_MODEL), "--heads", "4",
        "--seq-len", "64", "--batch", "8", "--lr", "3e-3", "--eval-every", "0",
        "--eval-batches", "2", "--timing-warmup", "2", "--stats-every", "5", "--quiet"]  # fmt: skip
CONFIGS = {
    "pp_fp4quant": ["--parallel", "pp", "--codec", "fp4quant-g64"],
    "tp_native_graph": ["--codec", "native", "--cuda-graph"],
    "sp_bf16": ["--sequence-parallel"],
    "tp_nvfp4_ef": ["--codec", "nvfp4", "--error-feedback"],
}
RUN_TIMEOUT_S = 600


def _ranks():
    return int(os.environ.get("FP4_COMM_TEST_RANKS", "2"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    ranks, gpus = _ranks(), torch.cuda.device_count()
    if ranks > gpus and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        pytest.skip(f"{ranks} ranks on {gpus} GPU(s): needs NCCL >= 2.30 with "
                    "NCCL_MULTI_RANK_GPU_ENABLE=1 (nox -s gpu_multirank)")  # fmt: skip
    return write_corpus(tmp_path_factory.mktemp("tp_gpu") / "corpus.txt")


def _torchrun(corpus, out, ranks, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(ranks), "-m", "fp4_train.experiments.tp_train",
           *TINY, "--data", str(corpus), "--out", str(out), *extra]  # fmt: skip
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    (record,) = [p for p in out.glob("*.json")]
    return json.loads(record.read_text())


def _losses(record):
    return [s["loss"] for s in record["steps"]]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_gpu_configuration_trains(corpus, tmp_path, config):
    if "pp" in CONFIGS[config] and _ranks() != 2:
        pytest.skip("the pipeline has two stages: FP4_COMM_TEST_RANKS=2")
    record = _torchrun(corpus, tmp_path, _ranks(), "--steps", str(STEPS), *CONFIGS[config])
    losses = _losses(record)
    assert record["world_size"] == _ranks() and len(losses) == STEPS
    assert all(math.isfinite(v) for v in losses), losses
    # from ln(256) = 5.55 (uniform bytes) towards the unigram entropy of English text
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


def test_exact_communication_matches_one_process_on_the_gpu(corpus, tmp_path):
    exact = ["--steps", str(EXACT_STEPS), "--codec", "none-float32", "--dtype", "float32"]
    single = _losses(_torchrun(corpus, tmp_path / "one", 1, *exact))
    parallel = _losses(_torchrun(corpus, tmp_path / "tp", _ranks(), *exact))
    # As on the CPU: the split reorders float32 sums of length <= 4 d, once per layer forward
    # and twice backward; AdamW's normalized steps carry the difference on.
    rtol = 3 * LAYERS * 4 * D_MODEL * U32 * EXACT_STEPS
    for a, b in zip(single, parallel, strict=True):
        assert abs(a - b) <= rtol * abs(a), (single, parallel)
