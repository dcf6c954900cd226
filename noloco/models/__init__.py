"""The models a run trains (design.md §2): ``llama`` (noloco's own LLaMA, ``model.source=noloco``) and ``hf`` (a
``transformers`` causal LM behind the same ``forward(tokens, targets) -> (logits, loss)``, ``model.source=hf``) and
``convert`` (noloco's LLaMA as a transformers ``LlamaForCausalLM``, for export).
Nothing here imports the training harness: settings come in as arguments.
"""
