"""Text for the language models, shared by training and inference.

  tokenizer  SentencePiece tokenizers: a named model, or one trained on the corpus and cached
  corpus     C4-style JSON lines (or the embedded corpus), packed into sharded resumable batches; `load_tokenizer`
"""
