"""A PyTorch training loop fed by ``ferry.prefetch``: the next batches upload while the model trains.

    python examples/train_with_prefetch.py [--steps 200] [--batch 256] [--backend auto]

The batches are CPU tensors, as a ``torch.utils.data.DataLoader`` yields them. ``ferry.prefetch``
keeps ``depth`` of them uploading while the model works on the current one and hands each one to
PyTorch's current stream without a host wait (``to="torch"``): the loop never waits for a copy.

On a GPU the model trains there. Without one, ferry runs on its emulated device, whose memory
PyTorch cannot use: each batch is copied back to the host and the model trains on the CPU, so the
same loop still runs end to end.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

import ferry


def batches(torch: Any, steps: int, size: int) -> Iterator[tuple[Any, Any]]:
    """A labelled toy problem: is the sum of 32 features positive?"""
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(size, 32, generator=generator)
        yield x, (x.sum(dim=1) > 0).long()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "emulated"])
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("skipped: this example needs PyTorch (pip install torch)", file=sys.stderr)
        return {}
    with ferry.Runtime(args.backend) as rt:
        if rt.backend == "cuda" and torch.version.cuda is not None:
            device, to = torch.device("cuda", rt.device), "torch"  # device tensors, ordered on the current stream
        else:  # the emulated device (or a CPU-only PyTorch): train on the host
            device = torch.device("cpu")

            def to(array: ferry.DeviceArray) -> Any:
                return torch.from_numpy(rt.to_host(array))

        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for x, y in ferry.prefetch(batches(torch, args.steps, args.batch), depth=2, runtime=rt, to=to):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        k = max(1, min(10, len(losses) // 2))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(f"{len(losses)} steps on the {rt.backend} device, training on {device}: "
              f"loss {first:.3f} (first {k} steps) -> {last:.3f} (last {k})")
    return {"first": first, "last": last, "steps": len(losses)}


if __name__ == "__main__":
    main()
