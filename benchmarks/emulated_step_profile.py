"""Where one step of emulated tensor parallelism spends its time: the GPU's kernels or the host.

    python benchmarks/emulated_step_profile.py [--tp 4] [--codec none] [--model qwen-125m] \
        [--rounding stochastic] [--error-feedback] [--grad-codec tahquant-grad]

On a GPU: the ``fp4_train.experiments.emulated_tp`` runner of ``--tp`` emulated ranks (16
sequences of 1024 tokens of random ids, bf16 autocast) warms up, then reports the wall time of a
step (mean of 5, synchronized), the kernel time of a step (``torch.profiler``, two steps) and
their ratio, the ops and autograd functions of most device and host time, and the Python
functions of most own time (cProfile, two steps).  Kernel time well below the wall time says
the step waits on the host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--codec", default="none")
    ap.add_argument("--grad-codec", default=None, help="the backward codec (default: --codec)")
    ap.add_argument("--model", default="qwen-125m")
    ap.add_argument("--rounding", default="nearest", choices=["nearest", "stochastic"])
    ap.add_argument("--error-feedback", action="store_true")
    ap.add_argument("--rows", type=int, default=14, help="rows of each table")
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from fp4_train.experiments import emulated_tp, tp_train
    from fp4_train.experiments.corpus import train_batch

    if not torch.cuda.is_available():
        raise SystemExit("emulated_step_profile: needs a CUDA GPU")
    run_args = tp_train.parse_args([
        "--model", args.model, "--batch", "16", "--seq-len", "1024", "--steps", "20",
        "--data-format", "random", "--vocab", "16384", "--eval-every", "0",
        "--stats-every", "0", "--timing-warmup", "0", "--quiet", "--device", "cuda",
        "--codec", args.codec, "--rounding", args.rounding,
        *(["--error-feedback"] if args.error_feedback else []),
        *(["--grad-codec", args.grad_codec] if args.grad_codec else []),
    ])  # fmt: skip
    device = torch.device("cuda")
    runner = emulated_tp.EmulatedRunner(run_args, device, 16384, args.tp)
    tokens, _, _ = tp_train.load_data(run_args)
    count = iter(range(10**9))

    def step():
        i = next(count)
        x, y = train_batch(tokens, i, run_args.batch, run_args.seq_len, run_args.seed)
        runner.step(x.to(device), y.to(device), log_stats=False)

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / 5 * 1e3

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    kernel_ms = sum(e.self_device_time_total for e in table) / 2 / 1e3
    print(f"{args.model}, tp {args.tp}, codec {args.codec}, {args.rounding}"
          f"{', error feedback' if args.error_feedback else ''}: wall {wall_ms:.1f} ms a step, "
          f"kernels {kernel_ms:.1f} ms ({kernel_ms / wall_ms:.0%} of the wall time)")  # fmt: skip
    for key in ("self_device_time_total", "self_cpu_time_total"):
        print(table.table(sort_by=key, row_limit=args.rows, max_name_column_width=60))

    prof_py = cProfile.Profile()
    prof_py.enable()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    prof_py.disable()
    out = io.StringIO()
    pstats.Stats(prof_py, stream=out).sort_stats("tottime").print_stats(2 * args.rows)
    print(out.getvalue())


if __name__ == "__main__":
    main()
