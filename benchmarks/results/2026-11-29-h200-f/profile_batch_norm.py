"""Runs the BatchNorm training forward (256, 2048, 7, 7) fp16 and fp32 a few times, for Nsight
Compute (the run's ncu command is in its log)."""
import torch

from deploykit.ops import batch_norm as bn

for dtype in (torch.float16, torch.float32):
    x = torch.randn(256, 2048, 7, 7, device="cuda").to(dtype)
    w = torch.rand(2048, device="cuda") + 0.5
    b = torch.randn(2048, device="cuda")
    for _ in range(3):
        bn.train_forward(x, w, b, None, None, 0.1, 1e-5)
    torch.cuda.synchronize()
    print(dtype, "done", flush=True)
