import sys
from pathlib import Path

# test helpers (tiny models, reward fixtures) import as top-level modules, also in worker processes
sys.path.insert(0, str(Path(__file__).resolve().parent))
