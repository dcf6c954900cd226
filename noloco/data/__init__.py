"""Text for training: documents, tokenizers, token files and batches (design.md §2; docs/your-model-and-data.md).

``documents`` (the bundled corpora and the user's files, the held-out split), ``hf`` (a ``datasets`` dataset as
documents), ``tokenizer`` (the trained byte-level BPE or ``data.tokenizer``), ``tokens`` (token files in the cache),
``corpus`` (:func:`~noloco.data.corpus.prepare_corpus`, the one way in), ``sampler`` (deterministic batches),
``stream`` (a streamed dataset, each worker its shard) and ``stream_end`` (what a run does when a stream runs out).
Nothing here imports the training harness: settings come in as arguments (``corpus_options`` turns a ``data`` config
section into them; ``stream_end`` reads the few run keys it needs into its own ``StreamEndConfig``).
"""
