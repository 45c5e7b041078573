"""Make ``_oracle`` (the shared test oracles beside this file) importable from every test folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
