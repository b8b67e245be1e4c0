"""Text for the language models, shared by training and inference.

  tokenizer     SentencePiece tokenizers: a named model, or one trained on the corpus and cached; `load_or_train`
                also opens a checkpoint's tokenizer.json (`hf_tokenizer`)
  hf_tokenizer  a Hugging Face checkpoint's tokenizer.json
  corpus        C4-style JSON lines (or the embedded corpus), packed into sharded resumable batches; `load_tokenizer`

`TokenizerError` lives here, below both tokenizers (`tokenizer` imports `hf_tokenizer`, never the other way).
"""


class TokenizerError(ValueError):
  """A tokenizer model that cannot serve the objectives."""
