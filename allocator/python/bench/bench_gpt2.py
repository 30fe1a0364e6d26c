"""GPT-2 124M training under one allocator, in this process.

    python bench_gpt2.py --allocator {native,expandable,async,tidepool}
                         --workload {fixed,varlen,sidestream} [--steps 30]

GPT2Config() defaults with random weights (seeded, built on the CPU so every
allocator starts from the same weights), bf16 autocast, AdamW, batch 8.
Workloads: fixed = 8x512 tokens; varlen = 8 x L, L drawn from 64..1024 per
step (seeded); sidestream = fixed, with each next batch copied to the GPU on
a prefetch stream and handed to the default stream with record_stream.
Prints one JSON line: median step time, peak reserved and peak allocated
(PyTorch's max_memory_*; tidepool's reserved_high / used_high), the first
losses as fp32 Python floats.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--allocator", required=True, choices=["native", "expandable", "async", "tidepool"])
    ap.add_argument("--workload", required=True, choices=["fixed", "varlen", "sidestream"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.allocator == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif args.allocator == "async":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if args.allocator == "tidepool":
        import tidepool_torch

        tidepool_torch.install()

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config()
    model = GPT2LMHeadModel(config)  # random init on the CPU: identical for every allocator
    model = model.cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    gen = torch.Generator().manual_seed(1234)
    vocab = config.vocab_size

    def batch_for(step):
        if args.workload == "varlen":
            length = int(torch.randint(64, 1025, (1,), generator=gen).item())
        else:
            length = args.seq
        return torch.randint(0, vocab, (args.batch, length), generator=gen)

    side = torch.cuda.Stream() if args.workload == "sidestream" else None

    def prefetch(step):
        cpu = batch_for(step).pin_memory()
        with torch.cuda.stream(side):
            gpu = cpu.to("cuda", non_blocking=True)
        return gpu

    losses, times = [], []
    nxt = prefetch(0) if side is not None else None
    for step in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if side is not None:
            ids = nxt
            torch.cuda.current_stream().wait_stream(side)
            ids.record_stream(torch.cuda.current_stream())
            if step + 1 < args.steps:
                nxt = prefetch(step + 1)
        else:
            ids = batch_for(step).to("cuda", non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.detach().float()
        del out, ids
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))

    if args.allocator == "tidepool":
        import tidepool_torch

        peak_reserved = tidepool_torch.max_memory_reserved()
        peak_allocated = tidepool_torch.max_memory_allocated()
        extra = {
            k: v
            for k, v in tidepool_torch.memory_stats().items()
            if k.startswith("tidepool.")
        }
    else:
        peak_reserved = torch.cuda.max_memory_reserved()
        peak_allocated = torch.cuda.max_memory_allocated()
        extra = {}
    result = {
        "allocator": args.allocator,
        "workload": args.workload,
        "steps": args.steps,
        "median_step_ms": statistics.median(times) * 1e3,
        "median_step_ms_after_5": statistics.median(times[5:]) * 1e3 if len(times) > 5 else None,
        "peak_reserved_mib": peak_reserved / 2**20,
        "peak_allocated_mib": peak_allocated / 2**20,
        "losses": losses[:5],
        "last_loss": losses[-1],
        "device_used_mib": (lambda f_t: (f_t[1] - f_t[0]) / 2**20)(torch.cuda.mem_get_info()),
        "torch": torch.__version__,
        "extra": extra,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
