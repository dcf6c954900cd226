"""A small LLaMA-style decoder: RMSNorm, rotary position embeddings, SwiGLU, no biases.

The architecture of the NoLoCo paper's models (arXiv 2506.10911, following LLaMA), written to fit
in one's head (nanoGPT style). ``PRESETS`` holds the CPU default and the paper's sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    hidden_dim: int | None = None  # SwiGLU width; default 8/3·dim rounded up to a multiple of 64
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("model head dimension (dim / n_heads) must be even for rotary embeddings")
        if self.hidden_dim is None:
            self.hidden_dim = 64 * math.ceil(8 * self.dim / 3 / 64)

    def num_parameters(self) -> int:
        """Parameters of the model this config builds (tied embeddings counted once), without building it."""
        d, h, v = self.dim, self.hidden_dim, self.vocab_size
        per_block = 4 * d * d + 3 * d * h + 2 * d  # qkv + out, gate_up + down, two RMSNorms
        return v * d * (1 if self.tie_embeddings else 2) + self.n_layers * per_block + d

    def buffer_numel(self) -> int:
        """Values of its buffers (the rotary cos/sin tables: ``max_seq_len`` × head dim)."""
        return self.max_seq_len * (self.dim // self.n_heads)


PRESETS: dict[str, dict] = {
    # CPU default: a few million parameters, trains in minutes on 2 cores.
    "tiny": dict(dim=256, n_layers=4, n_heads=4),
    "small": dict(dim=384, n_layers=6, n_heads=6),
    # The paper's sizes (vocab from the data config).
    "125m": dict(dim=768, n_layers=12, n_heads=12, tie_embeddings=False),
    "1.3b": dict(dim=2048, n_layers=24, n_heads=16, tie_embeddings=False),
    "6.8b": dict(dim=4096, n_layers=32, n_heads=32, tie_embeddings=False),
}


def model_config(preset: str, **overrides) -> ModelConfig:
    """Build a :class:`ModelConfig` from a preset name plus explicit overrides (``None`` = keep)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model.preset {preset!r}; known: {sorted(PRESETS)}")
    known = {f.name for f in fields(ModelConfig)}
    values = dict(PRESETS[preset])
    for key, value in overrides.items():
        if key not in known:
            raise ValueError(f"unknown model option {key!r}")
        if value is not None:
            values[key] = value
    return ModelConfig(**values)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim/2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (even, odd) of the last dim. x: (B, H, T, D); cos/sin: (T, D/2)."""
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, dim // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.hidden_dim, bias=False)
        self.down = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LLaMA(nn.Module):
    """Decoder-only language model. ``forward(tokens, targets)`` returns (logits, mean CE loss)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        # torch's own initializations are skipped (reset_parameters sets every value): the embedding gets an empty
        # table, the rest is made on the meta device and then given empty storage where tensors go here (a caller's
        # ``with torch.device(...)`` included). Not the embedding on meta: its init there imports torch._dynamo.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        device = self.embed.weight.device
        with torch.device("meta"):
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for module in (self.blocks, self.norm, self.head):
            module.to_empty(device=device)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters(torch.Generator().manual_seed(seed))

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, 0.02) init, residual projections scaled by 1/sqrt(2·layers); norms at 1.

        Uses its own ``generator`` (not the global RNG), so replicas built in parallel threads get
        identical weights from the same seed.
        """
        residual_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if param.dim() < 2:
                nn.init.ones_(param)  # the RMSNorm gains
                continue
            std = residual_std if name.endswith(("out.weight", "down.weight")) else self.cfg.init_std
            nn.init.normal_(param, mean=0.0, std=std, generator=generator)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss
