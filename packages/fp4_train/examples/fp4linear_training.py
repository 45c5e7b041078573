"""The MLP of stored_weight_training.py with FP4Linear layers: NVFP4 GEMM operands, bfloat16
master weights.  Does the rounding choice still matter?

    python packages/fp4_train/examples/fp4linear_training.py [--out DIR] [--device cpu]

The same teacher-student task (64 -> 256 -> 256 -> 16, ReLU, AdamW lr 1e-3, batch 256, 3 seeds)
with every ``nn.Linear`` replaced by ``FP4Linear``: the forward, dgrad and wgrad GEMMs run on
NVFP4-quantized operands, while the master weights are kept in bfloat16: AdamW (float32
moments) updates them and every update is rounded to nearest bfloat16, as for the ``bf16``
method of stored_weight_training.py.  Activations stay float32 (bfloat16 matmuls are slow on a
CPU; the FP4 GEMM operands are quantized from them either way).  Configurations:

- ``bf16 nn.Linear``: the reference, no FP4 anywhere, the same bfloat16 master weights;
- ``fp4 nearest``: forward operands and gradients rounded to nearest;
- ``fp4 stochastic grads``: forward to nearest, gradients stochastically (the recipe);
- ``fp4 stochastic all``: forward operands and gradients stochastically;
- ``fp4 stochastic grads + hadamard``: the recipe plus the random Hadamard transform on the
  weight-gradient GEMM.

Writes fp4_train_fp4linear.{json,csv,png} into --out: by default a folder of the
temporary directory, so that a rerun leaves the committed copies in docs/results alone
(`--out docs/results` from the repository root rewrites them).
"""

from __future__ import annotations

import numpy as np
import torch
from _common import figure, markdown_table, metadata, parse_args, progress, write_csv, write_json
from stored_weight_training import EVAL_EVERY, SEEDS, fit, mlp, round_to_bfloat16, task

from fp4_train import FP4Linear

CONFIGS = {
    "bf16 nn.Linear": None,
    "fp4 nearest": {"rounding": "nearest", "grad_rounding": "nearest"},
    "fp4 stochastic grads": {"rounding": "nearest", "grad_rounding": "stochastic"},
    "fp4 stochastic all": {"rounding": "stochastic", "grad_rounding": "stochastic"},
    "fp4 stochastic grads + hadamard": {
        "rounding": "nearest",
        "grad_rounding": "stochastic",
        "hadamard_wgrad": True,
    },
}


def fp4_model(dims, options, seed, device):
    model = mlp(dims, device)
    layers = []
    for i, m in enumerate(model):
        if isinstance(m, torch.nn.Linear) and options is not None:
            m = FP4Linear.from_linear(m, seed=seed * 100 + i, **options)
        layers.append(m)
    model = torch.nn.Sequential(*layers)
    round_to_bfloat16(model)
    return model


def train(name, seed, device):
    dims, make_opt, steps, *data = task("mlp", seed, device)
    torch.manual_seed(seed)
    model = fp4_model(dims, CONFIGS[name], seed, device)
    opt = make_opt(model.parameters())
    return fit(model, opt, data, steps, seed, device, f"{name} seed {seed}",
               after_step=lambda step: round_to_bfloat16(model))  # fmt: skip


def main():
    args = parse_args(__doc__)
    meta = metadata(args.device)
    results, rows = {}, []
    for name in progress(CONFIGS, desc="configurations"):
        curves = np.stack([train(name, s, args.device) for s in SEEDS])
        final = curves[:, -1]
        results[name] = {
            "options": CONFIGS[name],
            "final_test_loss_mean": float(final.mean()),
            "final_test_loss_std": float(final.std()),
            "final_test_loss_per_seed": final.tolist(),
            "curve_mean": curves.mean(0).tolist(),
        }
    base = results["bf16 nn.Linear"]["final_test_loss_mean"]
    for name, r in results.items():
        rows.append(
            {
                "configuration": name,
                "final_test_loss_mean": f"{r['final_test_loss_mean']:.5g}",
                "final_test_loss_std": f"{r['final_test_loss_std']:.2g}",
                "ratio_to_bf16": f"{r['final_test_loss_mean'] / base:.3g}",
            }
        )
    write_json(
        args.out / "fp4_train_fp4linear.json",
        {"meta": meta, "seeds": list(SEEDS), "eval_every": EVAL_EVERY, "results": results},
    )
    write_csv(args.out / "fp4_train_fp4linear.csv", rows)
    with figure(args.out / "fp4_train_fp4linear.png", figsize=(7, 4)) as (fig, ax):
        for name, r in results.items():
            c = np.array(r["curve_mean"])
            ax.plot(np.arange(len(c)) * EVAL_EVERY, c, label=name)
        ax.set(
            yscale="log",
            xlabel="step",
            ylabel="held-out MSE (mean of 3 seeds)",
            title="MLP with FP4Linear (NVFP4 operands, bf16 master weights)",
        )
        ax.legend(fontsize=8)
    print(
        markdown_table(
            ["configuration", "final test MSE (mean ± std, 3 seeds)", "/ bf16"],
            [
                [
                    r["configuration"],
                    f"{r['final_test_loss_mean']} ± {r['final_test_loss_std']}",
                    r["ratio_to_bf16"],
                ]
                for r in rows
            ],
        )
    )

    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
