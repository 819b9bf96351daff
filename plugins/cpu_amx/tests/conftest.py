import sys
from pathlib import Path

# --import-mode=importlib puts no test folder on sys.path; the shared problem builders live here.
sys.path.insert(0, str(Path(__file__).parent))
