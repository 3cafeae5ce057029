import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

# Tiny models: one intra-op thread is faster than two spinning on a 2-core CI machine.
torch.set_num_threads(1)
