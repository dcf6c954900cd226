"""noloco's LLaMA (:mod:`noloco.models.llama`) as a transformers ``LlamaForCausalLM`` that computes the same logits.

The fused ``qkv`` and ``gate_up`` weights are split into Llama's ``q/k/v_proj`` and ``gate/up_proj``, and the rows of
``q`` and ``k`` of every head are permuted from noloco's rotary convention (pairs of even and odd dimensions) to
Llama's (the first and second half of the head). :func:`save_llama` writes what ``save_pretrained`` would:
``config.json`` and ``model.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from noloco.models.llama import LLaMA


def rope_permutation(head_dim: int) -> torch.Tensor:
    """Row order taking one head of noloco's q/k (rotating pairs 2i, 2i+1) to Llama's (rotating i, i + d/2)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def llama_config(model: LLaMA, eot_id: int | None = None):
    """The ``LlamaConfig`` of ``model``'s shape; ``eot_id`` is its BOS and EOS token (None: none)."""
    from transformers import LlamaConfig

    c = model.cfg
    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.hidden_dim,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_heads,
        head_dim=c.dim // c.n_heads,
        hidden_act="silu",
        max_position_embeddings=c.max_seq_len,
        initializer_range=c.init_std,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=None,
        architectures=["LlamaForCausalLM"],
    )


@torch.no_grad()
def llama_state_dict(model: LLaMA) -> dict[str, torch.Tensor]:
    """noloco's LLaMA weights under LlamaForCausalLM's names (q/k rows permuted for Llama's rotary)."""
    c = model.cfg
    head_dim = c.dim // c.n_heads
    perm = rope_permutation(head_dim)

    def rope_rows(weight: torch.Tensor) -> torch.Tensor:
        return weight.view(c.n_heads, head_dim, -1)[:, perm].reshape(c.dim, -1)

    out = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight,
           "lm_head.weight": model.head.weight}  # fmt: skip
    for i, block in enumerate(model.blocks):
        prefix = f"model.layers.{i}."
        q, k, v = block.attn.qkv.weight.chunk(3, dim=0)
        gate, up = block.mlp.gate_up.weight.chunk(2, dim=0)
        out.update({
            prefix + "input_layernorm.weight": block.attn_norm.weight,
            prefix + "self_attn.q_proj.weight": rope_rows(q),
            prefix + "self_attn.k_proj.weight": rope_rows(k),
            prefix + "self_attn.v_proj.weight": v,
            prefix + "self_attn.o_proj.weight": block.attn.out.weight,
            prefix + "post_attention_layernorm.weight": block.mlp_norm.weight,
            prefix + "mlp.gate_proj.weight": gate,
            prefix + "mlp.up_proj.weight": up,
            prefix + "mlp.down_proj.weight": block.mlp.down.weight,
        })  # fmt: skip
    return {name: t.detach().float().contiguous().clone() for name, t in out.items()}


def save_llama(model: LLaMA, out: Path, eot_id: int | None = None) -> None:
    """Write ``model`` as a ``LlamaForCausalLM`` folder: config.json and model.safetensors (what
    ``save_pretrained`` writes; a tied ``lm_head`` is stored once, as the embedding)."""
    from safetensors.torch import save_file

    config = llama_config(model, eot_id)
    state = llama_state_dict(model)
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    config.save_pretrained(out)
    save_file(state, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
