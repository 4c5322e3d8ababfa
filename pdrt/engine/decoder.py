"""pdrt's own forward pass over the weights of a Llama-family model (llama, mistral, qwen2).

transformers' forward runs some 450 modules a step on a 30-layer model, each
with its hooks and wrappers, and multiplies every row by the query, key,
value, gate and up projections one by one. On a small model decoding a few
sequences on the CPU, that overhead is a large share of a step. This forward runs
the same arithmetic, in the same order, as flat tensor calls: the query, key
and value projections become one matrix, as do gate and up (each output
element is the same dot product, so the numbers do not change), and rotary
embedding turns the queries and keys in one pass. Attention is pdrt's paged
attention (pdrt/engine/attention.py), called as transformers would call it.

`fuse_projections` rewrites the loaded model's modules in place (the fused
weights replace the separate ones, so memory stays the same); after it, the
transformers forward of that model no longer runs, and `Decoder` is its
forward.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdrt.engine.attention import AttentionMetadata, paged_attention


def _fused(parts: list[torch.nn.Linear]) -> torch.nn.Linear:
    """One linear layer whose output is the outputs of `parts`, concatenated."""
    has_bias = parts[0].bias is not None
    weight = torch.cat([p.weight.detach() for p in parts])
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device,
                            dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias.detach() for p in parts]))
    return fused


def fuse_projections(model: torch.nn.Module) -> None:
    """Replace each layer's q/k/v projections by `qkv_proj` and its gate/up projections by `gate_up_proj`."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _fused([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp.gate_up_proj = _fused([mlp.gate_proj, mlp.up_proj])
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: statistics in float32, the weight applied in the input's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # the same arithmetic in one kernel
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return weight * (x.to(torch.float32) * torch.rsqrt(variance + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(slots=True)
class _Layer:
    attn: torch.nn.Module  # transformers' attention module: paged attention reads its layer index
    qkv: torch.nn.Module
    o: torch.nn.Module
    gate_up: torch.nn.Module
    down: torch.nn.Module
    act: torch.nn.Module
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    scaling: float


class Decoder:
    """The forward pass of a model that went through `fuse_projections` (and, on the CPU, packing)."""

    def __init__(self, model: torch.nn.Module) -> None:
        config, inner = model.config, model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = model.lm_head
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.intermediate = config.intermediate_size
        self.layers = [_Layer(layer.self_attn, layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                              layer.mlp.gate_up_proj, layer.mlp.down_proj, layer.mlp.act_fn,
                              layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                              layer.input_layernorm.variance_epsilon, layer.self_attn.scaling)
                       for layer in inner.layers]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | int,
                 meta: AttentionMetadata) -> torch.Tensor:
        """Logits `[rows, vocab]` of the rows `keep` (0: every row) of the packed step `input_ids` `[1, T]`."""
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids=positions)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # over the heads of `[1, T, heads, head_dim]`
        num_tokens = input_ids.shape[1]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        for layer in self.layers:
            x = _rms_norm(hidden, layer.input_norm, layer.eps)
            qkv = layer.qkv(x).view(1, num_tokens, h + 2 * kvh, d)
            qk = qkv[:, :, : h + kvh]
            qk = qk * cos + _rotate_half(qk) * sin  # queries and keys turned together
            query, key = qk[:, :, :h].transpose(1, 2), qk[:, :, h:].transpose(1, 2)
            value = qkv[:, :, h + kvh :].transpose(1, 2)
            out, _ = paged_attention(layer.attn, query, key, value, None, scaling=layer.scaling,
                                     pdrt_attention=meta)
            hidden = hidden + layer.o(out.reshape(1, num_tokens, h * d))
            x = _rms_norm(hidden, layer.post_norm, layer.eps)
            gate_up = layer.gate_up(x)
            hidden = hidden + layer.down(layer.act(gate_up[..., : self.intermediate])
                                         * gate_up[..., self.intermediate :])
        hidden = _rms_norm(hidden, self.norm, self.norm_eps)
        if not isinstance(keep, int):
            hidden = hidden[:, keep]
        return self.lm_head(hidden)[0]
