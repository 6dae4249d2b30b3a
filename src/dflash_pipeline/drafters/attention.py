"""The attention backend of the drafter's layers: which dtype attention computes in, flex attention
(compiled on the GPU, eager on the CPU) and a dense DFlash mask turned into a flex BlockMask.

`layers.Attention.attend` calls these for every caller (training, scoring, the static inference
cache); tests switch the compiled path on for the CPU through `COMPILE_FLEX_ON`.
"""

import torch


def attention_dtype(v: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's when it is on for v's device type, else v's."""
    device_type = v.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return v.dtype


# Device types where flex_attention runs compiled. CPU runs it eager by default (compiling costs
# ~20 s and cannot train: torch has no flex backward on CPU); tests add "cpu" to run the compiled path.
COMPILE_FLEX_ON = ("cuda",)
_COMPILED_FLEX = {}


def flex_attention_fn(device: torch.device):
    """flex_attention, compiled (one fused kernel) on the device types in COMPILE_FLEX_ON, eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type not in COMPILE_FLEX_ON:
        return flex_attention
    if device.type not in _COMPILED_FLEX:
        # Dynamic shapes on CUDA (every batch packs a different length). Inductor's CPU flex template
        # fails to build dynamic kernels when Q != K (torch 2.13), so the CPU compiles per shape.
        _COMPILED_FLEX[device.type] = torch.compile(flex_attention, dynamic=device.type == "cuda")
    return _COMPILED_FLEX[device.type]


def to_block_mask(mask: torch.Tensor):
    """A dense [Q, K] DFlash mask as a flex-attention BlockMask (built once per forward)."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask

    def visible(batch, head, query, key):
        return mask[query, key]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused; it is only for tests there
        return create_block_mask(visible, B=None, H=None, Q_LEN=mask.shape[0], KV_LEN=mask.shape[1], device=mask.device)
