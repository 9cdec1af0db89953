"""``gpu_health.lost_context`` on a real GPU: fine before, and the reason after a device-side assert
(an embedding given an id beyond its table, as a BERT request with a bad token id does). In a
subprocess, as the assert poisons the CUDA context of the process that triggers it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU that torch sees", allow_module_level=True)

POISON = """
import torch
from deploykit.serving.gpu_health import lost_context
print("before:", lost_context("cuda:0"))
table = torch.nn.Embedding(10, 4).cuda()
try:
    table(torch.tensor([12], device="cuda:0"))
    torch.cuda.synchronize()
except Exception:
    pass
print("after:", lost_context("cuda:0"))
"""


def test_a_device_side_assert_leaves_the_context_lost_and_says_why():
    done = subprocess.run([sys.executable, "-c", POISON], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = done.stdout.splitlines()[-2:]
    assert before == "before: None" and "device-side assert" in after, done.stdout
