"""One GPT-style decoder for every scale, its attention a registry kernel chosen per layer.

Pre-LN blocks (Radford et al. 2019, GPT-2; layout as in Karpathy's minGPT):
x + Attn(LN(x)), then x + MLP(LN(x)); learned token and position embeddings, a
final LayerNorm and an untied output head; no dropout, no weight tying, no fused or
compiled ops. Attention is ``attnum.kernels.Attention`` around one registry kernel per
layer (reference, flash emulator under a policy, torch's SDPA, our Triton kernel),
always causal. The query/key/value projection has a bias, so a common key offset mu
(seed 004) is a change of one bias vector (``add_key_offset``): it leaves the forward
unchanged in exact arithmetic.

Two settings of ``GPTConfig`` choose the numerics; their defaults are the tiny CPU models of
studies 03-05 (everything as the caller's autocast leaves it):

* ``amp``: the forward runs under ``torch.autocast`` in this dtype ("off": not by the model;
  ``GPTConfig.byte_lm`` sets "bf16", the GPU language model's setting): weights and optimiser
  state stay fp32, the linear layers compute in bf16;
* ``attention_dtype``: when set, attention is called *outside* autocast on operands cast to
  this dtype (``AttentionChoice``): ``sdpa:flash`` reads the bf16 q, k, v the projections
  produced, ``sdpa:math`` reads them upcast to fp32, so "FP32 attention" is attention computed
  in fp32 on the same bf16-computed projections, not a different model. Per layer a ``capture``
  dict then keeps the operands the kernel read and the upstream gradient ``dO`` it was given (a
  tensor hook), for the FP32-recompute diagnostic (``attnum.train.diag``).

Weights are initialised from an explicit seed on the CPU (``init_weights``), so identical
seeds give bitwise-identical models on every device; ``perturb_weights`` adds a seeded tiny
perturbation (the chaos baseline of a weight-drift study).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .kernels import Attention, AttentionImpl, Kernel, as_kernel

IGNORE = -100
"""Target id of a position that is not scored (``F.cross_entropy``'s default ``ignore_index``)."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
AMPS = ("off", "bf16", "fp16", "fp32")  # "fp32" is autocast off, as "off"
# registry families whose attention is fp32 unless the choice names another dtype
_FP32_BY_DEFAULT = ("sdpa:math", "reference:fp32", "golden")


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """A model's attention: a registry kernel name and the dtype of the operands it reads.

    Written ``<registry name>[@<dtype>]``, e.g. ``sdpa:flash`` (bf16), ``sdpa:math@fp32``,
    ``triton:fa2:gproj_dq``. Without ``@``: fp32 for ``sdpa:math``, ``reference:fp32`` and
    ``golden`` (the fp32 baseline), else ``default_dtype`` (the autocast dtype).
    """

    kernel_name: str
    dtype: str

    @classmethod
    def parse(cls, text: str, default_dtype: str = "bf16") -> "AttentionChoice":
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"an attention choice is '<kernel>[@<dtype>]', got {text!r}")
        name, _, dtype = text.strip().partition("@")
        if not dtype:
            dtype = "fp32" if name in _FP32_BY_DEFAULT else default_dtype
        if dtype not in DTYPES:
            raise ValueError(f"attention dtype of {text!r} must be one of {list(DTYPES)}, got {dtype!r}")
        kernels.get(name)  # a clear error for an unknown kernel, before any work
        return cls(name, dtype)

    @property
    def label(self) -> str:
        return f"{self.kernel_name}@{self.dtype}"

    def kernel(self) -> kernels.Kernel:
        return kernels.get(self.kernel_name)

    def unavailable_reason(self, device) -> str | None:
        return self.kernel().unavailable_reason(device)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    context: int = 64
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    mlp_ratio: int = 4
    attention: tuple = (AttentionImpl(),)  # one kernel (a registry name, Kernel or AttentionImpl) per layer, or one for all
    amp: str = "off"  # autocast dtype of the forward (see the module docstring)
    attention_dtype: str | None = None  # None: attention reads the operands as they come; else cast, autocast off
    qk_norm: bool = False  # LayerNorm over each head's queries and keys before the scores (qk-layernorm)

    def __post_init__(self) -> None:
        for key in ("vocab_size", "context", "n_layer", "n_head", "d_model", "mlp_ratio"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if self.amp not in AMPS:
            raise ValueError(f"amp must be one of {list(AMPS)}, got {self.amp!r}")
        if self.attention_dtype is not None and self.attention_dtype not in DTYPES:
            raise ValueError(f"attention_dtype must be None or one of {list(DTYPES)}, got {self.attention_dtype!r}")
        impls = self.attention if isinstance(self.attention, (tuple, list)) else (self.attention,)
        impls = tuple(as_kernel(i) for i in impls)
        if len(impls) == 1:
            impls = impls * self.n_layer
        if len(impls) != self.n_layer:
            raise ValueError(f"attention names {len(impls)} implementations for {self.n_layer} layers")
        object.__setattr__(self, "attention", impls)

    @classmethod
    def byte_lm(cls, choice: AttentionChoice | str = "sdpa:flash", *, n_layer: int = 12, n_head: int = 12,
                d_model: int = 768, context: int = 1024, amp: str = "bf16", qk_norm: bool = False) -> "GPTConfig":
        """The GPU language model: GPT-2 small's geometry (Qiu & Yao's model, arXiv 2510.04212) on bytes
        (vocabulary 256), the matmuls under ``amp`` autocast, attention in the choice's dtype."""
        choice = AttentionChoice.parse(choice) if isinstance(choice, str) else choice
        return cls(vocab_size=256, context=context, n_layer=n_layer, n_head=n_head, d_model=d_model,
                   attention=(choice.kernel_name,), amp=amp, attention_dtype=choice.dtype, qk_norm=qk_norm)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def n_params(self, blocks_only: bool = False) -> int:
        d, f = self.d_model, self.mlp_ratio * self.d_model
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        block += 4 * (d // self.n_head) if self.qk_norm else 0
        extra = 0 if blocks_only else self.vocab_size * d + self.context * d + 2 * d + d * self.vocab_size
        return self.n_layer * block + extra


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, kernel: Kernel):
        super().__init__()
        self.n_head, self.d_model = cfg.n_head, cfg.d_model
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=True)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)
        self.attention = Attention(kernel)
        if cfg.qk_norm:  # Wortsman et al. 2023 (arXiv 2309.14322), after Dehghani et al. 2023: LN(q), LN(k) per head
            self.ln_q = nn.LayerNorm(cfg.d_model // cfg.n_head)
            self.ln_k = nn.LayerNorm(cfg.d_model // cfg.n_head)
        self.qk_norm = cfg.qk_norm
        self.dtype = None if cfg.attention_dtype is None else DTYPES[cfg.attention_dtype]
        self.record_stats = False
        self.stats: dict[str, float] = {}
        self.capture: dict | None = None  # a dict: keep q, k, v as read and dO of the next call (attention_dtype set)

    @property
    def kernel(self) -> Kernel:
        return self.attention.kernel

    def attend(self, q, k, v):
        """The kernel on operands in ``self.dtype``, autocast off (the kernel's own numerics)."""
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = (t.to(self.dtype) for t in (q, k, v))
            if self.capture is not None:
                self.capture.update(q=q.detach(), k=k.detach(), v=v.detach())
            out = self.kernel(q, k, v, is_causal=True)
            if self.capture is not None and out.requires_grad:
                cap = self.capture
                out.register_hook(lambda g: cap.__setitem__("grad_out", g.detach()))
        return out

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.qk_norm:
            q, k = self.ln_q(q), self.ln_k(k)
        if self.record_stats:
            self.stats = attention_statistics(q.detach(), k.detach())
        y = self.attention(q, k, v, is_causal=True) if self.dtype is None else self.attend(q, k, v)
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
    """Pre-LN block: x + Attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, cfg: GPTConfig, kernel: Kernel):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, kernel)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, kernel) for kernel in cfg.attention)
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, seed)  # on the CPU from one seeded generator: the same on every device

    @property
    def amp(self) -> str:
        return self.cfg.amp

    def logits(self, idx):
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds the context {self.cfg.context}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def forward(self, idx, targets=None):
        if self.cfg.amp in ("off", "fp32"):
            logits = self.logits(idx)
        else:
            with torch.autocast(idx.device.type, dtype=DTYPES[self.cfg.amp]):
                logits = self.logits(idx)
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
