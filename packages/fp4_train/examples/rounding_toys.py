"""Two toy experiments on one NVFP4 block: a value between grid points, and sub-step accumulation.

    python packages/fp4_train/examples/rounding_toys.py [--out DIR] [--device cpu]

The block [6, w, 0, ..., 0] (16 elements) has amax 6, so its NVFP4 decode scale is
448 * fl(1/448) = 1 up to a float32 ulp: w sits on the e2m1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6.

1. The value 2.3 (between the grid points 2 and 3), quantized T times:
   round to nearest gives 2 every time; stochastic rounding gives 3 with probability 0.3, so
   its running mean tends to 2.3 (standard error sqrt(0.21 / t)); round to nearest with error
   feedback (``ErrorFeedback``) gives a sequence of 2s and 3s whose running mean is within
   |r_t| / t <= 0.5 / t of 2.3.
2. Sub-step accumulation: a weight stored in NVFP4, starting at 0.5, receives T = 100 updates
   of +0.05 (a tenth of the grid step 0.5 at 0.5), each stored with nearest, stochastic or
   error-feedback rounding (``FP4StoredWeights`` over plain SGD).  Exact arithmetic ends at 5.5.
   Stochastic rounding is run as 64 independent weights (rows) to show its spread.

Writes fp4_train_value_2p3.{json,png} and fp4_train_accumulation.{json,csv,png} into --out:
by default a folder of the temporary directory, so that a rerun leaves the committed copies in
docs/results alone (`--out docs/results` from the repository root rewrites them).
"""

from __future__ import annotations

import numpy as np
import torch
from _common import figure, markdown_table, metadata, parse_args, progress, write_csv, write_json

import fp4_kernels
from fp4_train import ErrorFeedback, FP4StoredWeights

VALUE = 2.3
T_VALUE = 4000
T_ACCUMULATE = 100
INCREMENT = 0.05
START = 0.5
SR_RUNS = 64


def block(rows, value, device):
    x = torch.zeros(rows, 16, device=device)
    x[:, 0] = 6.0
    x[:, 1] = value
    return x


def value_between_grid_points(device):
    x = block(1, VALUE, device)
    nearest = float(fp4_kernels.quantize_dequantize(x)[0, 1])
    ef = ErrorFeedback()
    sr, fed = np.empty(T_VALUE), np.empty(T_VALUE)
    for t in progress(range(T_VALUE), desc="2.3: SR and error feedback"):
        sr[t] = float(
            fp4_kernels.quantize_dequantize(x, rounding="stochastic", seed=1, step=t)[0, 1]
        )
        fed[t] = float(ef.qdq("x", x)[0, 1])
    t = np.arange(1, T_VALUE + 1)
    return {
        "value": VALUE,
        "steps": T_VALUE,
        "nearest": nearest,
        "stochastic_mean": float(sr.mean()),
        "stochastic_standard_error": float(np.sqrt(0.3 * 0.7 / T_VALUE)),
        "error_feedback_mean": float(fed.mean()),
        "error_feedback_bound": 0.5 / T_VALUE,
        "error_feedback_values": sorted({round(v, 5) for v in fed}),
        "curves": {
            "t": t,
            "stochastic": np.cumsum(sr) / t,
            "error_feedback": np.cumsum(fed) / t,
        },
    }


def accumulate(rounding, rows, device):
    p = torch.nn.Parameter(block(rows, START, device))
    opt = FP4StoredWeights(torch.optim.SGD([p], lr=INCREMENT), rounding=rounding, seed=7)
    grad = torch.zeros(rows, 16, device=device)
    grad[:, 1] = -1.0  # SGD: w <- w - lr * grad = w + INCREMENT
    path = np.empty((T_ACCUMULATE + 1, rows))
    opt.materialize()
    path[0] = p.detach()[:, 1].cpu().numpy()
    for t in progress(range(T_ACCUMULATE), desc=f"accumulate: {rounding}"):
        opt.materialize()
        p.grad = grad.clone()
        opt.step()
        opt.materialize()
        path[t + 1] = p.detach()[:, 1].cpu().numpy()
    if rounding == "error_feedback":  # element 1 of the flattened, padded weight
        residual = float(opt._error_feedback.residual("param0")[1])
        return path, residual
    return path


def main():
    args = parse_args(__doc__)
    meta = metadata(args.device)

    v = value_between_grid_points(args.device)
    curves = v.pop("curves")
    write_json(args.out / "fp4_train_value_2p3.json", {"meta": meta, **v})
    with figure(args.out / "fp4_train_value_2p3.png", figsize=(7, 4)) as (fig, ax):
        t = curves["t"]
        ax.axhline(VALUE, color="k", lw=0.8, label="2.3")
        ax.axhline(v["nearest"], color="tab:red", label="nearest (every step)")
        ax.plot(t, curves["stochastic"], color="tab:blue", label="stochastic: running mean")
        se = np.sqrt(0.21 / t)
        ax.fill_between(t, VALUE - se, VALUE + se, color="tab:blue", alpha=0.15, label="±1 s.e.")
        ax.plot(t, curves["error_feedback"], color="tab:green", label="nearest + error feedback")
        ax.set_xscale("log")
        ax.set_ylim(1.9, 2.7)
        ax.set(
            xlabel="quantizations t",
            ylabel="mean of the first t dequantized values",
            title="NVFP4: 2.3 between the grid points 2 and 3",
        )
        ax.legend(loc="upper right", fontsize=8)

    paths = {
        "nearest": accumulate("nearest", 1, args.device)[:, 0],
        "stochastic": accumulate("stochastic", SR_RUNS, args.device),
    }
    ef_path, ef_residual = accumulate("error_feedback", 1, args.device)
    paths["error_feedback"] = ef_path[:, 0]
    exact = START + INCREMENT * np.arange(T_ACCUMULATE + 1)
    sr_final = paths["stochastic"][-1]
    summary = {
        "start": START,
        "increment": INCREMENT,
        "steps": T_ACCUMULATE,
        "exact_final": float(exact[-1]),
        "nearest_final": float(paths["nearest"][-1]),
        "stochastic_final_mean": float(sr_final.mean()),
        "stochastic_final_std": float(sr_final.std()),
        "stochastic_runs": SR_RUNS,
        "error_feedback_final": float(paths["error_feedback"][-1]),
        "error_feedback_final_residual": ef_residual,
        "error_feedback_stored_plus_residual": float(paths["error_feedback"][-1]) + ef_residual,
    }
    write_json(args.out / "fp4_train_accumulation.json", {"meta": meta, **summary})
    write_csv(
        args.out / "fp4_train_accumulation.csv",
        [
            {
                "step": i,
                "exact": f"{exact[i]:.4f}",
                "nearest": f"{paths['nearest'][i]:.6g}",
                "stochastic_mean": f"{paths['stochastic'][i].mean():.6g}",
                "stochastic_std": f"{paths['stochastic'][i].std():.6g}",
                "error_feedback": f"{paths['error_feedback'][i]:.6g}",
            }
            for i in range(T_ACCUMULATE + 1)
        ],
    )
    with figure(args.out / "fp4_train_accumulation.png", figsize=(7, 4)) as (fig, ax):
        steps = np.arange(T_ACCUMULATE + 1)
        ax.plot(steps, exact, color="k", lw=0.8, label="exact")
        ax.plot(steps, paths["nearest"], color="tab:red", label="nearest")
        m, s = paths["stochastic"].mean(1), paths["stochastic"].std(1)
        ax.plot(steps, m, color="tab:blue", label=f"stochastic (mean of {SR_RUNS})")
        ax.fill_between(steps, m - s, m + s, color="tab:blue", alpha=0.15, label="±1 std")
        ax.step(
            steps, paths["error_feedback"], where="post", color="tab:green", label="error feedback"
        )
        ax.set(
            xlabel="updates of +0.05",
            ylabel="stored NVFP4 weight",
            title="Sub-step accumulation in an NVFP4-stored weight",
        )
        ax.legend(fontsize=8)

    print(
        markdown_table(
            ["experiment", "exact", "nearest", "stochastic", "error feedback"],
            [
                [
                    f"2.3, mean of {T_VALUE}",
                    VALUE,
                    f"{v['nearest']:.4f}",
                    f"{v['stochastic_mean']:.4f} (s.e. {v['stochastic_standard_error']:.4f})",
                    f"{v['error_feedback_mean']:.4f}",
                ],
                [
                    f"0.5 + {T_ACCUMULATE} x 0.05",
                    f"{exact[-1]:.2f}",
                    f"{summary['nearest_final']:.4f}",
                    f"{summary['stochastic_final_mean']:.3f}"
                    f" ± {summary['stochastic_final_std']:.3f}",
                    f"{summary['error_feedback_final']:.4f}",
                ],
            ],
        )
    )

    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
