"""A small GPT-style decoder whose attention implementation is chosen per layer.

Pre-LN blocks (Radford et al. 2019, GPT-2; layout as in Karpathy's minGPT):
x + Attn(LN(x)), then x + MLP(LN(x)); learned token and position embeddings, a
final LayerNorm and an untied output head. Attention is ``attnum.kernels.Attention``
around one registry kernel per layer (reference, flash emulator under a policy, or
torch's SDPA), always causal. The query/key/value projection has a bias, so a
common key offset mu (seed 004) is a change of one bias vector
(``add_key_offset``): it leaves the forward unchanged in exact arithmetic.

Weights are initialised from an explicit seed (``init_weights``), so identical
seeds give bitwise-identical models; ``perturb_weights`` adds a seeded tiny
perturbation (the chaos baseline of a weight-drift study).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import Attention, AttentionImpl, Kernel, as_kernel
from .tasks import IGNORE


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    context: int = 64
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    mlp_ratio: int = 4
    attention: tuple = (AttentionImpl(),)  # one kernel (a registry name, Kernel or AttentionImpl) per layer, or one for all

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")
        impls = self.attention if isinstance(self.attention, (tuple, list)) else (self.attention,)
        impls = tuple(as_kernel(i) for i in impls)
        if len(impls) == 1:
            impls = impls * self.n_layer
        if len(impls) != self.n_layer:
            raise ValueError(f"attention names {len(impls)} implementations for {self.n_layer} layers")
        object.__setattr__(self, "attention", impls)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, kernel: Kernel):
        super().__init__()
        self.n_head, self.d_model = cfg.n_head, cfg.d_model
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=True)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)
        self.attention = Attention(kernel)
        self.record_stats = False
        self.stats: dict[str, float] = {}

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.record_stats:
            self.stats = attention_statistics(q.detach(), k.detach())
        y = self.attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


@torch.no_grad()
def attention_statistics(q, k, scale: float | None = None, extended: bool = False) -> dict[str, float]:
    """Sharpness and key statistics of causal attention with scores q k^T * scale, in fp32.

    ``max_logit``: largest scaled score; ``entropy``: mean over rows of -sum P log P (nats);
    ``key_mean_norm``: ||mean_j k_j|| (mean over batch and heads); ``key_norm``: mean_j ||k_j||;
    ``key_mean_ratio``: their ratio (1 when every key is the same vector, ~1/sqrt(N) for random keys).
    ``extended`` adds ``offset_logit`` (mean |q . mean_j k_j| * scale, the logit the common key offset
    adds) and ``max_prob`` (mean row maximum of P).
    """
    q, k = q.float(), k.float()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    n = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    logp = torch.log_softmax(s, dim=-1)
    entropy = -(logp.exp() * torch.where(torch.isinf(logp), torch.zeros_like(logp), logp)).sum(-1)
    key_mean_norm = k.mean(dim=-2).norm(dim=-1)
    key_norm = k.norm(dim=-1).mean(dim=-1)
    stats = {"max_logit": s.amax().item(), "entropy": entropy.mean().item(),
             "key_mean_norm": key_mean_norm.mean().item(), "key_norm": key_norm.mean().item(),
             "key_mean_ratio": (key_mean_norm / key_norm).mean().item()}
    if extended:
        offset = (q @ k.mean(dim=-2).unsqueeze(-1)).squeeze(-1).abs().mean() * scale
        stats.update(offset_logit=offset.item(), max_prob=logp.exp().amax(-1).mean().item())
    return stats


class Block(nn.Module):
    """Pre-LN block; ``attn``: an attention module of another model (``attnum.lm``) in place of this
    module's ``CausalSelfAttention(cfg, kernel)``."""

    def __init__(self, cfg: GPTConfig, kernel: Kernel | None = None, attn: nn.Module | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, kernel) if attn is None else attn
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def lm_logits(model: nn.Module, idx):
    """Token and position embeddings, the blocks, the final LayerNorm and the head: the forward pass up to
    the logits of ``GPT`` and of ``attnum.lm``'s LM (any module with those parts and ``cfg.context``)."""
    t = idx.shape[1]
    if t > model.cfg.context:
        raise ValueError(f"sequence length {t} exceeds the context {model.cfg.context}")
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(t, device=idx.device))
    for block in model.blocks:
        x = block(x)
    return model.head(model.ln_f(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, kernel) for kernel in cfg.attention)
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, seed)

    def forward(self, idx, targets=None):
        logits = lm_logits(self, idx)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=IGNORE)
        return logits, loss

    def attention_modules(self) -> list[CausalSelfAttention]:
        return [block.attn for block in self.blocks]

    def set_attention(self, kernel: Kernel | AttentionImpl | str, layers=None) -> None:
        """Change the attention kernel of some layers (all by default)."""
        kernel = as_kernel(kernel)
        for i, attn in enumerate(self.attention_modules()):
            if layers is None or i in layers:
                attn.attention.kernel = kernel


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """GPT-2 initialisation from one seeded generator: N(0, 0.02) weights, residual outputs
    scaled by 1/sqrt(2 n_layer), zero biases, unit LayerNorm gains."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n_layer = getattr(getattr(model, "cfg", None), "n_layer", 1)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
        elif ".ln" in name or name.startswith("ln_"):
            p.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            p.zero_()


@torch.no_grad()
def perturb_weights(model: nn.Module, eps: float, seed: int) -> None:
    """Add eps * N(0, 1) to every parameter, from one seeded generator (eps = 0: no change)."""
    if eps == 0:
        return
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p) * eps)


@torch.no_grad()
def add_key_offset(model: GPT, layer: int, mu: torch.Tensor) -> None:
    """Add ``mu`` (shape (d_model,), or (head_dim,) for every head) to every key of a layer.

    Implemented on the key bias, so every key of every position shifts by mu: each
    row's scores shift by the constant q_i . mu, which softmax ignores exactly.
    """
    attn = model.attention_modules()[layer]
    d = attn.d_model
    mu = mu.to(attn.qkv.bias)
    if mu.numel() == d // attn.n_head:
        mu = mu.repeat(attn.n_head)
    if mu.numel() != d:
        raise ValueError(f"key offset must have {d} or {d // attn.n_head} entries, got {mu.numel()}")
    attn.qkv.bias[d:2 * d] += mu


def layer_parameters(model: GPT, layer: int) -> list[nn.Parameter]:
    return list(model.blocks[layer].parameters())


def grad_norms(model: GPT, layer: int) -> dict[str, float]:
    """Gradient norms of one block: all its parameters, and the query and key projections alone."""
    params = [p for p in model.blocks[layer].parameters() if p.grad is not None]
    total = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).item() if params else 0.0
    attn = model.attention_modules()[layer]
    d = attn.d_model
    qk = 0.0
    for p in (attn.qkv.weight, attn.qkv.bias):
        if p.grad is not None:
            qk += (p.grad[:2 * d].double() ** 2).sum().item()
    return {"grad_norm": total, "grad_norm_qk": math.sqrt(qk)}
