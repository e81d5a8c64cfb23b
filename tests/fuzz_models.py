"""Random small models built from the ops autotp supports, for fuzzing the pass.

A :class:`NetSpec` is a plain frozen value (it pickles to the ranks); :class:`FuzzNet` builds the
model it describes, reading top to bottom like a nanoGPT block:

    x: token ids (b, s) -> embedding [+ positions]      or   features (b, s, d_in) -> linear
    blocks: mlp | gated mlp | attention (sdpa or spelled out) | parallel attention+mlp | norm |
            pointwise | head views | reductions | concatenated branches | slices | permutes |
            broadcast (unsqueeze/expand) dims,
            each optionally pre-normed (layer norm / RMS norm) and residual; an mlp's
            activation optionally in place (``nn.ReLU(inplace=True)``, ``tanh_``)
    head:   linear to outputs | lm head (optionally tied) + cross-entropy loss | none

:func:`net_specs` is the hypothesis strategy: a spec, a tp, and a layout pinning some weights to
drawn roles (which may be infeasible: autotp must then say so, not crash).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BLOCKS = ("mlp", "gated", "attention", "parallel", "norm", "pointwise", "heads_view", "reduce", "concat",
          "halves", "permute", "repeat")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "tanh", "silu", "sigmoid")
TRACE_BATCH, TRACE_SEQ = 2, 8  # what capture traces with (export specializes sizes 0 and 1)


@dataclass(frozen=True)
class Block:
    kind: str
    norm: str = "none"          # none | layer | rms
    residual: bool = True
    act: str = "gelu"
    hidden: int = 8             # mlp / gated inner width
    bias: bool = True
    fused_qkv: bool = True
    causal: bool = True
    sdpa: bool = True           # False: attention spelled out (matmul, masked_fill, softmax)
    flatten: bool = False       # run the linears on (b*s, d), as GPT-2 does
    inplace: bool = False       # the mlp's activation in place (nn.ReLU(inplace=True)), where torch has one


@dataclass(frozen=True)
class NetSpec:
    entry: str                  # embedding | linear
    heads: int
    head_dim: int
    vocab: int
    blocks: tuple[Block, ...]
    head: str                   # linear | loss | none
    out: int = 4
    positions: bool = False     # a learned position embedding (embedding entry)
    tied: bool = False          # lm head tied to the token embedding
    d_in: int = 5               # features of a linear entry

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    def inputs(self, batch: int, seq: int, seed: int, dtype=torch.float64) -> dict:
        gen = torch.Generator().manual_seed(seed)
        if self.entry == "embedding":
            x = torch.randint(0, self.vocab, (batch, seq), generator=gen)
        else:
            x = torch.randn(batch, TRACE_SEQ, self.d_in, generator=gen, dtype=dtype)  # seq is static here
        out = {"x": x}
        if self.head == "loss":
            out["targets"] = torch.randint(0, self.vocab, (batch, x.shape[1]), generator=gen)
        return out


def _activation(name: str, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if inplace and name in ("relu", "silu"):
        return getattr(F, name)(x, inplace=True)
    if inplace and name in ("tanh", "sigmoid"):
        return getattr(torch, name + "_")(x)
    return getattr(F, name)(x) if name in ("gelu", "relu", "silu") else getattr(torch, name)(x)


def _norm(kind: str, d: int) -> nn.Module:
    return {"layer": lambda: nn.LayerNorm(d), "rms": lambda: nn.RMSNorm(d, eps=1e-6),
            "none": nn.Identity}[kind]()


class Mlp(nn.Module):
    def __init__(self, d: int, b: Block):
        super().__init__()
        self.b = b
        self.fc = nn.Linear(d, b.hidden, bias=b.bias)
        self.gate = nn.Linear(d, b.hidden, bias=b.bias) if b.kind == "gated" else None
        self.proj = nn.Linear(b.hidden, d, bias=b.bias)

    def forward(self, x):                                   # (b, s, d)
        shape = x.shape
        if self.b.flatten:
            x = x.view(-1, shape[-1])                       # (b*s, d)
        h = _activation(self.b.act, self.fc(x), self.b.inplace)   # in place on the product's output
        if self.gate is not None:
            h = h * self.gate(x)                            # SwiGLU-like: two branches multiplied
        return self.proj(h).view(shape)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, b: Block):
        super().__init__()
        self.b, self.heads = b, heads
        if b.fused_qkv:
            self.qkv = nn.Linear(d, 3 * d, bias=b.bias)     # q | k | v, each `heads` heads
        else:
            self.q, self.k, self.v = (nn.Linear(d, d, bias=b.bias) for _ in range(3))
        self.proj = nn.Linear(d, d, bias=b.bias)

    def forward(self, x):                                   # (b, s, d)
        bsz, s, d = x.shape
        if self.b.fused_qkv:
            q, k, v = self.qkv(x).split(d, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (t.view(bsz, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))  # (b, h, s, hd)
        if self.b.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.b.causal)
        else:
            scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5    # (b, h, s, s)
            if self.b.causal:
                mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
                scores = scores.masked_fill(~mask, float("-inf"))
            y = torch.softmax(scores, dim=-1) @ v           # (b, h, s, hd)
        y = y.transpose(1, 2).reshape(bsz, s, d)            # (b, s, d)
        return self.proj(y)


class Pointwise(nn.Module):
    def __init__(self, d: int, b: Block):
        super().__init__()
        self.b = b
        self.scale = nn.Parameter(torch.ones(d) * 0.5)

    def forward(self, x):
        return _activation(self.b.act, x) * self.scale + 0.1 * x * x


class Reduce(nn.Module):
    """A norm spelled out: reductions over the hidden dim (mean, var) and rsqrt."""

    def forward(self, x):                                   # (b, s, d)
        centred = x - x.mean(-1, keepdim=True)
        return centred * torch.rsqrt(centred.var(-1, keepdim=True, correction=0) + 1e-5)


class Concat(nn.Module):
    """Two branches of different widths, concatenated and projected back."""

    def __init__(self, d: int, b: Block):
        super().__init__()
        self.b = b
        self.left = nn.Linear(d, b.hidden, bias=b.bias)
        self.right = nn.Linear(d, d, bias=b.bias)
        self.proj = nn.Linear(b.hidden + d, d, bias=b.bias)

    def forward(self, x):                                   # (b, s, d)
        h = torch.cat([_activation(self.b.act, self.left(x)), self.right(x)], dim=-1)  # (b, s, hidden + d)
        return self.proj(h)


class Halves(nn.Module):
    """Slices the hidden dim in two, scales one half, and puts them back in swapped order."""

    def forward(self, x):                                   # (b, s, d)
        d = x.shape[-1]
        first, second = x[..., : d // 2], x[..., d // 2:]   # (b, s, d//2), (b, s, d - d//2)
        return torch.cat([second * 2.0, torch.tanh(first)], dim=-1)


class Permute(nn.Module):
    """Attention-like data movement without attention: a softmax over the sequence per head."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def forward(self, x):                                   # (b, s, d)
        bsz, s, d = x.shape
        h = x.view(bsz, s, self.heads, d // self.heads).permute(0, 2, 3, 1)  # (b, h, hd, s)
        h = torch.softmax(h, dim=-1).permute(0, 3, 1, 2)   # (b, s, h, hd)
        # contiguous, as attention's output is before its projection: the product would keep the
        # permuted strides, and a later block's .view(-1, d) works on them only where b == 1
        return (h.reshape(bsz, s, d) * x).contiguous()


class Repeat(nn.Module):
    """Broadcasts a new dim (unsqueeze, expand), mixes it with a linear, and sums it away."""

    def __init__(self, d: int, b: Block):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=b.bias)

    def forward(self, x):                                   # (b, s, d)
        bsz, s, d = x.shape
        h = x.unsqueeze(2).expand(bsz, s, 2, d)             # (b, s, 2, d)
        h = self.proj(h) * torch.tensor([1.0, -0.5], dtype=x.dtype, device=x.device).view(2, 1)
        return h.sum(dim=2)                                 # (b, s, d)


class HeadsView(nn.Module):
    """Views the hidden dim as (heads, head_dim), mixes within each head, and views back."""

    def __init__(self, heads: int, head_dim: int, b: Block):
        super().__init__()
        self.heads, self.b = heads, b
        self.mix = nn.Parameter(torch.randn(head_dim) / head_dim)

    def forward(self, x):                                   # (b, s, d)
        bsz, s, d = x.shape
        h = x.view(bsz, s, self.heads, d // self.heads)     # (b, s, h, hd)
        h = torch.softmax(h, dim=-1) * self.mix
        return h.reshape(bsz, s, d)


class Layer(nn.Module):
    def __init__(self, spec: NetSpec, b: Block):
        super().__init__()
        d = spec.width
        self.b = b
        self.norm = _norm(b.norm, d)
        if b.kind in ("mlp", "gated"):
            self.body = Mlp(d, b)
        elif b.kind == "attention":
            self.body = Attention(d, spec.heads, b)
        elif b.kind == "parallel":                          # GPT-J: attention and mlp side by side
            self.body = Attention(d, spec.heads, b)
            self.side = Mlp(d, Block("mlp", act=b.act, hidden=b.hidden, bias=b.bias))
        elif b.kind == "pointwise":
            self.body = Pointwise(d, b)
        elif b.kind == "heads_view":
            self.body = HeadsView(spec.heads, spec.head_dim, b)
        elif b.kind == "reduce":
            self.body = Reduce()
        elif b.kind == "concat":
            self.body = Concat(d, b)
        elif b.kind == "halves":
            self.body = Halves()
        elif b.kind == "permute":
            self.body = Permute(spec.heads)
        elif b.kind == "repeat":
            self.body = Repeat(d, b)
        else:                                               # "norm": the norm is the block
            self.body = nn.Identity()

    def forward(self, x):
        h = self.norm(x)
        y = self.body(h)
        if self.b.kind == "parallel":
            y = y + self.side(h)
        return x + y if self.b.residual else y


class FuzzNet(nn.Module):
    def __init__(self, spec: NetSpec):
        super().__init__()
        self.spec = spec
        d = spec.width
        if spec.entry == "embedding":
            self.wte = nn.Embedding(spec.vocab, d)
            self.wpe = nn.Embedding(64, d) if spec.positions else None
        else:
            self.inp = nn.Linear(spec.d_in, d)
        self.layers = nn.ModuleList(Layer(spec, b) for b in spec.blocks)
        if spec.head == "linear":
            self.out = nn.Linear(d, spec.out)
        elif spec.head == "loss":
            self.lm_head = nn.Linear(d, spec.vocab, bias=False)
            if spec.tied and spec.entry == "embedding":
                self.lm_head.weight = self.wte.weight

    def forward(self, x, targets=None):
        if self.spec.entry == "embedding":
            h = self.wte(x)                                 # (b, s, d)
            if self.wpe is not None:
                h = h + self.wpe(torch.arange(x.shape[1], device=x.device))
        else:
            h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        if self.spec.head == "linear":
            return self.out(h)
        if self.spec.head == "loss":
            logits = self.lm_head(h)                        # (b, s, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            return loss, logits
        return h


def weight_roles(spec: NetSpec) -> dict[str, list[str]]:
    """The model's matrices (what a layout can pin), each with the roles that apply to it."""
    model = FuzzNet(spec)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {n: ["replicate", "vocab", "column"] if id(p) in embeddings else ["replicate", "column", "row"]
            for n, p in model.named_parameters() if p.dim() >= 2}


def net_specs(tps=(2, 4, 2, 1), max_blocks: int = 3):
    """Hypothesis strategy: (spec, tp, layout, profile, batch, seq, seed)."""
    from hypothesis import strategies as st

    @st.composite
    def block(draw):
        return Block(
            kind=draw(st.sampled_from(BLOCKS)),
            norm=draw(st.sampled_from(["none", "layer", "rms"])),
            residual=draw(st.booleans()),
            act=draw(st.sampled_from(ACTIVATIONS)),
            hidden=draw(st.integers(1, 12)),
            bias=draw(st.booleans()),
            fused_qkv=draw(st.booleans()),
            causal=draw(st.booleans()),
            sdpa=draw(st.booleans()),
            flatten=draw(st.booleans()),
            inplace=draw(st.booleans()),
        )

    @st.composite
    def case(draw):
        entry = draw(st.sampled_from(["embedding", "linear"]))
        spec = NetSpec(
            entry=entry,
            heads=draw(st.sampled_from([1, 2, 3, 4, 6])),
            head_dim=draw(st.sampled_from([1, 2, 4])),
            vocab=draw(st.integers(2, 24)),
            blocks=tuple(draw(st.lists(block(), min_size=1, max_size=max_blocks))),
            head=draw(st.sampled_from(["linear", "loss", "none"])),
            out=draw(st.integers(1, 9)),
            positions=draw(st.booleans()),
            tied=draw(st.booleans()),
        )
        layout = {}
        for name, roles in weight_roles(spec).items():  # None: left to the planner
            role = draw(st.sampled_from([None, *roles]))
            if role is not None:
                layout[name] = role
        return {
            "spec": spec,
            "tp": draw(st.sampled_from(tps)),
            "layout": layout,
            "profile": draw(st.sampled_from(["h100-dgx", "cpu-gloo"])),
            "batch": draw(st.integers(1, 3)),
            "seq": draw(st.integers(2, 7)),
            "seed": draw(st.integers(0, 2**16)),
        }

    return case()
