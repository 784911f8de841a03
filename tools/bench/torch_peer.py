"""The PyTorch DistributedDataParallel peer: N processes, one per device, same work as ours.

Each process builds the twin of our model (torch_models.py) from the same seed, wraps it in
DDP (gloo on CPU, NCCL on GPU), takes its share (global batch / N) of every step from a pool
of ready batches, and runs SGD with momentum 0.9 and weight decay 5e-4; DDP averages the
gradients, so an update uses the whole global batch as ours does. Rank 0 times each step
after the warm-up (DDP's all-reduce keeps the ranks in step) and writes the times to a file.

Thread budget on CPU: threads // N per process (at least 1), so the N processes together use
the cores TensorFlow's one process gets (worker.py). With more processes than cores the
processes share cores, as TensorFlow's logical devices do.
"""

import json
import os
import socket
import tempfile
import time

POOL_BATCHES = 2


def run_torch_ddp(run, image_shape, num_classes) -> dict:
    """Times `run` (a BenchRun of kind torch_ddp); {"step_times_s", "parameters", ...}."""
    if run.dtype != "float32":
        raise ValueError(f"the PyTorch peer runs float32 only: compare at --dtype=float32, not {run.dtype}")
    import torch
    import torch.multiprocessing as mp
    use_cuda = run.cpu_devices == 0 and torch.cuda.is_available()
    if use_cuda and torch.cuda.device_count() < run.devices:
        raise RuntimeError(f"{run.devices} GPUs wanted, PyTorch sees {torch.cuda.device_count()}")
    if run.batch % run.devices:
        raise ValueError(f"global batch {run.batch} does not divide by {run.devices} processes")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        args = (run.to_json(), list(image_shape), num_classes, _free_port(), out, use_cuda)
        mp.spawn(_rank_main, args=args, nprocs=run.devices, join=True)
        with open(out) as f:
            result = json.load(f)
    return {**result, "device_kind": "GPU" if use_cuda else "CPU", "torch_version": torch.__version__}


def _rank_main(rank, run_json, image_shape, num_classes, port, out, use_cuda):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from tools.bench.configs import BenchRun
    from tools.bench.torch_models import build

    run = BenchRun.from_json(run_json)
    n = run.devices
    torch.set_num_threads(max(1, (run.threads or os.cpu_count()) // n))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=n)
    device = torch.device(f"cuda:{rank}" if use_cuda else "cpu")
    torch.manual_seed(run.seed)   # same initial weights on every rank (DDP also broadcasts them)
    model = build(run.model, image_shape, num_classes).to(device)
    ddp = DistributedDataParallel(model, device_ids=[rank] if use_cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)

    height, width, channels = image_shape
    share = run.batch // n
    generator = torch.Generator().manual_seed(run.seed * 1000 + rank)
    pool = [(torch.rand(share, channels, height, width, generator=generator).mul(2).sub(1).to(device),
             torch.randint(0, num_classes, (share,), generator=generator).to(device))
            for _ in range(POOL_BATCHES)]

    def step(i):
        images, labels = pool[i % POOL_BATCHES]
        optimizer.zero_grad(set_to_none=True)
        logits = ddp(images)
        loss = F.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        correct = (logits.argmax(1) == labels).sum()   # ours and Keras count hits too
        if use_cuda:
            torch.cuda.synchronize(device)
        return loss.item(), correct.item()

    for i in range(run.warmup_steps):
        step(i)
    times = []
    for i in range(run.timed_steps):
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_times_s": times, "parameters": sum(p.numel() for p in model.parameters()),
                       "threads": torch.get_num_threads() * n}, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
