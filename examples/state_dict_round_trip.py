"""Move a model's state dict to the GPU and back, every tensor in flight at once.

    python examples/state_dict_round_trip.py [--backend auto]

With PyTorch the state dict is a real model's (CPU tensors, taken without a copy); without it, a
dict of NumPy arrays of the same shapes. Every upload is submitted before the first is waited for,
so the copies overlap each other and ferry's staging lanes; ``ferry.wait_all`` then hands back
``(source, device array)`` pairs. On a GPU with PyTorch the device arrays become CUDA tensors
through DLPack (no copy). The way back is the same with downloads, and every byte is compared.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import ferry


def state_dict() -> dict[str, Any]:
    """A small transformer block's parameters: PyTorch's if it is installed, else NumPy arrays."""
    try:
        import torch
    except ImportError:
        rng = np.random.default_rng(0)
        shapes = {"attn.in_proj_weight": (1536, 512), "attn.in_proj_bias": (1536,), "attn.out_proj.weight": (512, 512),
                  "attn.out_proj.bias": (512,), "linear1.weight": (2048, 512), "linear1.bias": (2048,),
                  "linear2.weight": (512, 2048), "linear2.bias": (512,), "norm1.weight": (512,), "norm2.weight": (512,)}
        return {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}
    layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048)
    return dict(layer.state_dict())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "emulated"])
    args = parser.parse_args(argv)
    state = state_dict()
    nbytes = sum(np.asarray(v).nbytes for v in state.values())
    with ferry.Runtime(args.backend) as rt:
        start = time.perf_counter()
        up = ferry.wait_all([rt.upload(tensor) for tensor in state.values()])  # all submitted, then waited
        on_device = dict(zip(state, (device for _, device in up), strict=True))
        t_up = time.perf_counter() - start
        if rt.backend == "cuda":
            try:
                import torch

                cuda_tensors = {name: torch.from_dlpack(a) for name, a in on_device.items()}  # no copy
                print(f"as CUDA tensors: {len(cuda_tensors)}, e.g. {next(iter(cuda_tensors.values())).device}")
                del cuda_tensors  # (a model would load_state_dict() from them, or use them in place)
            except ImportError:
                pass
        start = time.perf_counter()
        down = ferry.wait_all([rt.download(a) for a in on_device.values()])
        back = dict(zip(state, (host for _, host in down), strict=True))
        t_down = time.perf_counter() - start
        for name, tensor in state.items():
            assert np.array_equal(back[name], np.asarray(tensor)), f"{name} did not come back intact"
        print(f"{len(state)} tensors, {nbytes / 2**20:.1f} MiB, on the {rt.backend} device: "
              f"to it in {t_up * 1e3:.1f} ms, back in {t_down * 1e3:.1f} ms, every byte equal")
    return {"tensors": len(state), "bytes": nbytes}


if __name__ == "__main__":
    main()
