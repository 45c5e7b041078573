"""Presets of tp_train runs under torchrun, then their summary: the command line of
``fp4_train.experiments.tp_sweep`` (its ``--help`` lists the options).

    python packages/fp4_train/examples/tp_sweep.py --preset cpu-boundary \
        --out docs/results/tp_boundary_cpu
"""

import sys

from fp4_train.experiments.tp_sweep import main

if __name__ == "__main__":
    sys.exit(main())
