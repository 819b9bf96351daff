"""Lets the tests here import their shared harness (pytest runs with --import-mode=importlib)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
