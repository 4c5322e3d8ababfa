"""Linear layers with their weights prepacked for oneDNN, for float32 models on the CPU.

A decode step multiplies a few rows (one per sequence) by every weight
matrix. torch's CPU linear hands that to MKL, which repacks the weight
matrix into its own blocked layout on every call: for few rows the repacking
costs as much as the product. oneDNN's linear takes a weight packed once, at
load (the same path torch's inductor uses for frozen CPU models): decode
steps of several sequences and prefills get faster, while a step of a single
sequence on one thread gets slower (MKL's matrix-vector path streams the
weights faster); scripts/bench_cpu_kernels.py measures both.

Weights below MIN_PACKED_WEIGHT stay with torch. The packed weight replaces
the original, so memory stays the same, except for an output projection tied
to the input embeddings, which keeps its copy for the embedding lookup.
PDRT_CPU_KERNELS=0 keeps torch's linear.
"""

import os

import torch

# oneDNN picks its blocking for this many rows; decode batches and prefill chunks both run well with it.
BATCH_HINT = 32
# oneDNN's call costs some 70 us more than MKL's, and what packing saves grows with the weight (about 1 ns
# an element at 16 rows): smaller weights (a tiny test model's, or GQA key/value projections) stay as they are.
MIN_PACKED_WEIGHT = 1 << 17


class PackedLinear(torch.nn.Module):
    """`nn.Linear` on a weight prepacked for oneDNN; inputs `[..., in_features]` as for the original."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # A plain attribute, not a buffer: the packed tensor is opaque to state_dict and to `.to()`.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(model: torch.nn.Module) -> bool:
    """Float32 on the CPU, with oneDNN in this torch build, and not switched off."""
    parameter = next(model.parameters(), None)
    return (os.environ.get("PDRT_CPU_KERNELS", "1") != "0" and parameter is not None
            and parameter.device.type == "cpu" and parameter.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_linears(model: torch.nn.Module, min_weight: int = MIN_PACKED_WEIGHT) -> int:
    """Replace every `nn.Linear` of `model` with at least `min_weight` weights by a `PackedLinear`, where
    `can_pack`; returns how many."""
    if not can_pack(model):
        return 0
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and child.weight.numel() >= min_weight]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
