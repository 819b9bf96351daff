import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # mla_reference, shared by the test modules
