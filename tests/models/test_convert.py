"""noloco's LLaMA as a transformers ``LlamaForCausalLM`` (noloco/models/convert.py) computes the same logits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from noloco.models.convert import save_llama  # noqa: E402
from noloco.models.llama import LLaMA, model_config  # noqa: E402

TOL = 1e-4  # max abs logit difference, fp32


@pytest.mark.parametrize(
    "options",
    [
        dict(dim=32, n_layers=2, n_heads=4),
        dict(dim=48, n_layers=1, n_heads=2, tie_embeddings=False, rope_theta=500.0, norm_eps=1e-6, hidden_dim=80),
    ],
)
def test_noloco_llama_as_llama_for_causal_lm_computes_the_same_logits(tmp_path, options):
    from transformers import LlamaForCausalLM

    model = LLaMA(model_config("tiny", vocab_size=300, max_seq_len=64, **options), seed=3).eval()
    with torch.no_grad():  # weights away from the init, norms away from 1
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_llama(model, tmp_path, eot_id=0)
    llama = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert llama.config.tie_word_embeddings == model.cfg.tie_embeddings
    x = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(x)[0] - llama(x).logits).abs().max().item() <= TOL
