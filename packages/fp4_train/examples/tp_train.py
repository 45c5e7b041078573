"""Tensor- or pipeline-parallel training with fp4_comm on the wire: the command line of
``fp4_train.experiments.tp_train`` (its ``--help`` lists the options).

    torchrun --standalone --nproc-per-node 2 packages/fp4_train/examples/tp_train.py \\
        --codec fp4quant --group-size 64 --steps 2000 --out docs/results/tp_runs
"""

from fp4_train.experiments.tp_train import main

if __name__ == "__main__":
    main()
