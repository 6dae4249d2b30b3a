"""Counting the reads a GPU would wait for (device-to-host copies), on a CPU run; and random training samples."""

import random

import torch
from torch.overrides import TorchFunctionMode

from dflash_pipeline.data.shards import Sample


def random_samples(seed: int, *, count: int, width: int = 6, top_k: int = 0):
    rng = random.Random(seed)
    samples = []
    for number in range(count):
        length = rng.randint(2, 120)
        prompt = rng.randint(0, length - 1)
        mask = [0] * prompt + [1 if rng.random() > 0.05 else 0 for _ in range(length - prompt)]
        ids = torch.tensor([rng.randrange(500) for _ in range(length)], dtype=torch.int32)
        extra = {}
        if top_k:
            extra = dict(target_topk_ids=torch.randint(0, 500, (length, top_k), dtype=torch.int32),
                         target_topk_logprobs=-torch.rand(length, top_k))
        samples.append(Sample(f"s{number}", ids, torch.tensor(mask, dtype=torch.uint8), ids,
                              torch.randn(length, width).to(torch.bfloat16), **extra))
    return samples

class DeviceReads(TorchFunctionMode):
    """Counts the calls that bring a tensor's value to Python (on a GPU each waits for the device):
    item, tolist, cpu, numpy, bool/int/float/index, nonzero, masked_select, unique, boolean-mask
    indexing, repeat_interleave with tensor repeats. `paused` switches counting off (host work).
    (`.to(device)` is not counted: on a CPU run it cannot tell a copy back from a no-op; the code
    under test reads back with `.cpu()`/`.tolist()`.)"""

    NAMES = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "masked_select", "unique",
             "unique_consecutive", "argwhere"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            name = getattr(func, "__name__", str(func))
            if name in self.NAMES:
                self.calls.append(name)
            elif name in ("__getitem__", "__setitem__") and self._boolean_index(args[1] if len(args) > 1 else None):
                self.calls.append(f"{name}[bool]")
            elif name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor) and "output_size" not in kwargs:
                self.calls.append("repeat_interleave(tensor)")
        return func(*args, **kwargs)

    @staticmethod
    def _boolean_index(index) -> bool:
        items = index if isinstance(index, tuple) else (index,)
        return any(isinstance(item, torch.Tensor) and item.dtype == torch.bool for item in items)

class Paused:
    def __init__(self, counter: DeviceReads, function):
        self.counter, self.function = counter, function

    def __call__(self, *args, **kwargs):
        self.counter.paused += 1
        try:
            return self.function(*args, **kwargs)
        finally:
            self.counter.paused -= 1
