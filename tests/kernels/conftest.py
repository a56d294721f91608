"""The kernel tests' shared helper module (`rounding.py`) importable by name: the suite runs with
--import-mode=importlib, which puts no test folder on sys.path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
