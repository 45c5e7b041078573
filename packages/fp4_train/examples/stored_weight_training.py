"""Training with the weights stored in NVFP4 and updated in place: bf16 vs nearest, stochastic,
error feedback.

    python packages/fp4_train/examples/stored_weight_training.py [--out DIR] [--device cpu]

Two synthetic tasks, each trained from the same initialization and data for every method:

- linear regression: y = x W*^T + noise (64 -> 16, noise std 0.1), full-precision
  ``nn.Linear``, SGD (lr 0.02, batch 256);
- a small MLP (64 -> 256 -> 256 -> 16, ReLU) fitted to a random teacher MLP of the same shape,
  AdamW (lr 1e-3, weight decay 0, batch 256).

Methods: ``float32`` (the reference: weights in float32), ``bf16`` (weights stored in bfloat16,
each update rounded to nearest), and NVFP4-stored weights (``FP4StoredWeights``) updated with
``nearest``, ``stochastic`` or ``error_feedback`` rounding.  The forward and backward passes run
in float32 on the decoded weights: only the storage of the weights is quantized.  Losses are on
a held-out set of 4096 samples, mean and spread over 3 seeds.

Writes fp4_train_stored_weights.{json,csv,png} into --out: by default a folder of the
temporary directory, so that a rerun leaves the committed copies in docs/results alone
(`--out docs/results` from the repository root rewrites them).
"""

from __future__ import annotations

import numpy as np
import torch
from _common import figure, markdown_table, metadata, parse_args, progress, write_csv, write_json

from fp4_train import FP4StoredWeights

METHODS = ("float32", "bf16", "nearest", "stochastic", "error_feedback")
SEEDS = (0, 1, 2)
EVAL_EVERY = 20
BATCH = 256


def mlp(dims, device):
    layers = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        layers.append(torch.nn.Linear(a, b, device=device))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def task(name, seed, device):
    """(make_model, optimizer_factory, steps, train_x, train_y, test_x, test_y)."""
    g = torch.Generator().manual_seed(1000 + seed)
    n_train, n_test = 8192, 4096
    x = torch.randn(n_train + n_test, 64, generator=g)
    if name == "linear_regression":
        w_true = torch.randn(16, 64, generator=g) / 8
        y = x @ w_true.T + 0.1 * torch.randn(n_train + n_test, 16, generator=g)
        dims, steps = (64, 16), 600

        def make_opt(params):
            return torch.optim.SGD(params, lr=0.02)

    else:
        torch.manual_seed(2000 + seed)
        teacher = mlp((64, 256, 256, 16), "cpu")
        with torch.no_grad():
            y = teacher(x)
            y = y / y.std()
        dims, steps = (64, 256, 256, 16), 1000

        def make_opt(params):
            return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)

    x, y = x.to(device), y.to(device)
    return dims, make_opt, steps, x[:n_train], y[:n_train], x[n_train:], y[n_train:]


@torch.no_grad()
def round_to_bfloat16(model):
    """Weights stored in bfloat16: round them (to nearest) after every update."""
    for p in model.parameters():
        p.copy_(p.bfloat16().float())


def fit(model, opt, data, steps, seed, device, desc, after_step=None):
    """Minibatch MSE training on ``data`` = (x, y, x_test, y_test), batches drawn from
    ``seed``; the held-out loss every EVAL_EVERY steps (model in eval mode), ``after_step(step)``
    after each optimizer step.  Returns the held-out loss curve."""
    x, y, x_test, y_test = data
    g = torch.Generator(device=device).manual_seed(seed)
    loss_fn = torch.nn.functional.mse_loss
    curve = []
    for step in progress(range(steps + 1), desc=desc, leave=False):
        if step % EVAL_EVERY == 0:
            with torch.no_grad():
                model.eval()
                curve.append(loss_fn(model(x_test), y_test).item())
                model.train()
        if step == steps:
            break
        idx = torch.randint(0, x.shape[0], (BATCH,), generator=g, device=device)
        loss = loss_fn(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step(step)
    return np.array(curve)


def train(task_name, method, seed, device):
    dims, make_opt, steps, *data = task(task_name, seed, device)
    torch.manual_seed(seed)
    model = mlp(dims, device)
    inner = make_opt(model.parameters())
    if method in ("float32", "bf16"):
        opt = inner
        if method == "bf16":
            round_to_bfloat16(model)
    else:
        opt = FP4StoredWeights(inner, rounding=method, seed=seed)
        opt.attach(model)
    memory = {}

    def after_step(step):
        if method == "bf16":  # the weights are stored in bfloat16: round every update
            round_to_bfloat16(model)
        if step == steps - 1 and isinstance(opt, FP4StoredWeights):
            memory.update(opt.memory_report())  # at rest: after a step, before the next forward

    desc = f"{task_name} {method} seed {seed}"
    curve = fit(model, opt, data, steps, seed, device, desc, after_step)
    if not isinstance(opt, FP4StoredWeights):
        memory = {"float32_bytes": sum(4 * p.numel() for p in model.parameters())}
        memory["optimizer_state_bytes"] = sum(
            v.numel() * v.element_size()
            for st in inner.state.values()
            for v in st.values()
            if torch.is_tensor(v)
        )
    max_abs_weight = max(p.detach().abs().max().item() for p in model.parameters())
    return curve, memory, max_abs_weight


def main():
    args = parse_args(__doc__)
    meta = metadata(args.device)
    results, rows = {}, []
    for task_name in ("linear_regression", "mlp"):
        results[task_name] = {}
        for method in progress(METHODS, desc=task_name):
            runs = [train(task_name, method, s, args.device) for s in SEEDS]
            curves = np.stack([c for c, _, _ in runs])
            final = curves[:, -1]
            results[task_name][method] = {
                "final_test_loss_mean": float(final.mean()),
                "final_test_loss_std": float(final.std()),
                "final_test_loss_per_seed": final.tolist(),
                "curve_mean": curves.mean(0).tolist(),
                "memory": runs[0][1],
                "final_max_abs_weight_per_seed": [m for _, _, m in runs],
            }
            rows.append(
                {
                    "task": task_name,
                    "method": method,
                    "final_test_loss_mean": f"{final.mean():.5g}",
                    "final_test_loss_std": f"{final.std():.2g}",
                    "ratio_to_float32": "",
                    "final_max_abs_weight": f"{np.mean([m for _, _, m in runs]):.3g}",
                }
            )
        base = results[task_name]["float32"]["final_test_loss_mean"]
        for r in rows:
            if r["task"] == task_name:
                r["ratio_to_float32"] = f"{float(r['final_test_loss_mean']) / base:.3g}"
    write_json(
        args.out / "fp4_train_stored_weights.json",
        {"meta": meta, "seeds": list(SEEDS), "eval_every": EVAL_EVERY, "results": results},
    )
    write_csv(args.out / "fp4_train_stored_weights.csv", rows)

    with figure(args.out / "fp4_train_stored_weights.png", 1, 2, figsize=(11, 4)) as (fig, axes):
        colors = dict(
            zip(METHODS, ["k", "tab:gray", "tab:red", "tab:blue", "tab:green"], strict=True)
        )
        for ax, task_name in zip(axes, results, strict=True):
            for method, r in results[task_name].items():
                c = np.array(r["curve_mean"])
                ax.plot(np.arange(len(c)) * EVAL_EVERY, c, color=colors[method], label=method)
            ax.set(
                yscale="log",
                xlabel="step",
                ylabel="held-out MSE (mean of 3 seeds)",
                title=f"{task_name.replace('_', ' ')}: weights stored in NVFP4",
            )
            ax.legend(fontsize=8)
    print(
        markdown_table(
            ["task", "method", "final test MSE (mean ± std, 3 seeds)", "/ float32", "max abs w"],
            [
                [
                    r["task"],
                    r["method"],
                    f"{r['final_test_loss_mean']} ± {r['final_test_loss_std']}",
                    r["ratio_to_float32"],
                    r["final_max_abs_weight"],
                ]
                for r in rows
            ],
        )
    )
    for method in METHODS:
        print(f"MLP memory, {method} (bytes): {results['mlp'][method]['memory']}")

    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
