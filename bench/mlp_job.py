"""The MLP job of the fake-CUDA benches (divergence-check.sh, fit-advice.sh).

    python bench/mlp_job.py WIDTH LAYERS BATCH STEPS
    python -m torch.distributed.run ... bench/mlp_job.py WIDTH LAYERS BATCH STEPS HEAVY_RANK

LAYERS Linear(WIDTH, WIDTH) + ReLU layers on the GPU, AdamW, STEPS steps on random
batches of BATCH, watched by stepwatch with ``micro_batch_size``; ``step N done``
after each step. Under torchrun: DistributedDataParallel over NCCL, and rank
HEAVY_RANK's micro-batch 24% larger (the same optimizer state on every rank).
"""

import os
import sys

import stepwatch
import torch

width, layers, batch, steps = (int(a) for a in sys.argv[1:5])
distributed = "LOCAL_RANK" in os.environ
if distributed:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if dist.get_rank() == int(sys.argv[5]):
        batch = batch * 124 // 100
with torch.device("cuda"):
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods)
    if distributed:
        model = DDP(model)
opt = torch.optim.AdamW(model.parameters())
stepwatch.watch(model, opt, micro_batch_size=batch)
for step in range(1, steps + 1):
    model(torch.randn(batch, width, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} done", flush=True)
stepwatch.flush(5)
if distributed:
    dist.destroy_process_group()
