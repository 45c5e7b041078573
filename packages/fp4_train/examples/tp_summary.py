"""The table and loss curves of a folder of tp_train runs: the command line of
``fp4_train.experiments.tp_summary``.

    python packages/fp4_train/examples/tp_summary.py docs/results/tp_cpu_smoke
"""

from fp4_train.experiments.tp_summary import main

if __name__ == "__main__":
    main()
