import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see dspark/__init__.py)

import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
os.environ.setdefault("DSPARK_NUM_THREADS", str(torch.get_num_threads()))  # no per-machine calibration in tests
