"""A lean GPT-2-style byte-level language model for the GPU, its attention a registry kernel.

Same architecture and parameter names as ``attnum.model.GPT`` (pre-LN blocks, learned token and
position embeddings, qkv and output projections with biases, GELU MLP, untied head; GPT-2
initialisation through ``attnum.model.init_weights``), so ``attnum.drift.tensor_kind`` and
``tensor_layer`` name its tensors. What differs, for speed and for the GPU questions:

* the matmuls run under ``torch.autocast`` in ``amp`` (bf16 by default): the weights and the
  optimiser state stay fp32, the linear layers compute in bf16;
* attention is called *outside* autocast, on operands cast to the attention dtype of the choice
  (``AttentionChoice``): ``sdpa:flash`` reads the bf16 q, k, v the projections produced, and
  ``sdpa:math`` reads them upcast to fp32, so "FP32 attention" is attention computed in fp32 on
  the same bf16-computed projections, not a different model;
* per layer a ``capture`` switch keeps the operands the kernel read and the upstream gradient
  ``dO`` it was given (a tensor hook), for the FP32-recompute diagnostic (``attnum.lm.diag``).

No dropout, no weight tying, no fused or compiled ops: what runs is what is written here.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .. import model
from ..model import init_weights

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
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
class LMConfig:
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    context: int = 1024
    vocab_size: int = 256
    mlp_ratio: int = 4

    def __post_init__(self):
        for key in ("n_layer", "n_head", "d_model", "context", "vocab_size", "mlp_ratio"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def n_params(self, blocks_only: bool = False) -> int:
        d, f = self.d_model, self.mlp_ratio * self.d_model
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        extra = 0 if blocks_only else self.vocab_size * d + self.context * d + 2 * d + d * self.vocab_size
        return self.n_layer * block + extra


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: LMConfig, choice: AttentionChoice):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=True)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)
        self.set_choice(choice)
        self.capture: dict | None = None  # a dict: keep q, k, v as read and dO of the next call

    def set_choice(self, choice: AttentionChoice) -> None:
        self.choice, self.kernel, self.dtype = choice, choice.kernel(), DTYPES[choice.dtype]

    def attend(self, q, k, v):
        """The kernel on operands in the choice's dtype, autocast off (the kernel's own numerics)."""
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
        y = self.attend(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def Block(cfg: LMConfig, choice: AttentionChoice) -> nn.Module:
    """``attnum.model``'s pre-LN block (same layers and tensor names) around this module's attention."""
    return model.Block(cfg, attn=CausalSelfAttention(cfg, choice))


class LM(nn.Module):
    """The language model; ``amp``: the autocast dtype of the matmuls ("off" for none)."""

    def __init__(self, cfg: LMConfig, choice: AttentionChoice, *, seed: int = 0, amp: str = "bf16"):
        super().__init__()
        if amp != "off" and amp not in DTYPES:
            raise ValueError(f"amp must be 'off' or one of {list(DTYPES)}, got {amp!r}")
        self.cfg, self.amp = cfg, amp
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, choice) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, seed)  # on the CPU from one seeded generator: the same on every device

    def attention_modules(self) -> list[CausalSelfAttention]:
        return [block.attn for block in self.blocks]

    def set_attention(self, choice: AttentionChoice) -> None:
        for attn in self.attention_modules():
            attn.set_choice(choice)

    def forward(self, idx, targets=None):
        enabled = self.amp not in ("off", "fp32")
        with torch.autocast(idx.device.type, dtype=DTYPES.get(self.amp, torch.bfloat16), enabled=enabled):
            logits = model.lm_logits(self, idx)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def initial_loss(vocab_size: int = 256) -> float:
    """The loss of a uniform prediction, ln(vocab): where training starts."""
    return math.log(vocab_size)
