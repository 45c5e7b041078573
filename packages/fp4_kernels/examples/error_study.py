"""The quantization-error study (docs/fp4quant_study.md): the command line of
``fp4_kernels.experiments.error_study`` (its ``--help`` lists the options).

    python packages/fp4_kernels/examples/error_study.py --out docs/results
"""

import sys

from fp4_kernels.experiments.error_study import main

if __name__ == "__main__":
    sys.exit(main())
