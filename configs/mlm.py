"""SMILE's masked-LM experiments: a BERT-like encoder whose every other FFN is an MoE layer, trained
on C4 with sequence length 128, LAMB and gradient accumulation.

  python -m experiments.train --config=configs/mlm.py --workdir=/tmp/mlm       # tiny, CPU-friendly
  python -m experiments.train --config=configs/mlm.py:3.7b --workdir=/ckpt/mlm-3.7b \\
      --config.data.train_files='/data/c4/en/c4-train.*-of-01024.json.gz'

Sizes after the colon: tiny (default; a 2 x 4 mesh of simulated CPU devices trains it in minutes on
the embedded corpus), and SMILE's Table 2 models on 16 nodes x 8 GPUs with 128 experts and a global
batch of 16384 sequences: 3.7b (12 layers, d 768, f 3072, micro-batch 128 per GPU), 13b (24, 1024,
4096, 64) and 48b (36, 1600, 6400, 64).

The mesh is `mesh` alone: no moe field resizes it. moe.num_nodes (read by routing=bilevel / node_limited only)
is a copy of mesh.nodes, checked against it (an error names both fields): change both together
(`--config.mesh.nodes=4 --config.moe.num_nodes=4`). moe.esp_schedule='auto' is resolved when the config is
checked (moejax.models.config.from_sections), for the tokens one layer call sees.
"""

import ml_collections

from configs.moe_section import moe_section

# layers, d_model, heads, d_ff, micro-batch rows per GPU
SIZES = {"3.7b": (12, 768, 12, 3072, 128), "13b": (24, 1024, 16, 4096, 64), "48b": (36, 1600, 25, 6400, 64)}
C4_STEPS = 61_500  # SMILE's 129B training tokens / (16384 x 128 tokens per step)


def get_config(size: str = "tiny") -> ml_collections.ConfigDict:
  if size != "tiny" and size not in SIZES:
    raise ValueError(f"unknown size {size!r}; choose tiny or one of {sorted(SIZES)}")
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.init_from = ""  # a local Hugging Face checkpoint directory whose weights start the run ('' = random init)
  config.steps = 300
  config.batch_size = 16  # sequences per optimizer step, over all devices and micro-batches
  config.micro_batches = 2  # gradient accumulation steps
  config.loss_chunk = 8192  # vocabulary columns per chunk of the output layer and loss (0: the whole logits at once)
  # With moe.buffer_factor set, a step whose receive buffers overflowed is repeated with the factor
  # doubled ('retry': training stays exact) or kept with the overflowed choices dropped ('drop').
  config.on_overflow = "retry"
  config.seq_len = 128
  config.mesh = ml_collections.ConfigDict({"nodes": 2, "gpus_per_node": 4})
  config.model = ml_collections.ConfigDict(
    {
      "kind": "bert",
      "vocab_size": 256,
      "num_layers": 2,
      "d_model": 64,
      "num_heads": 4,
      "d_ff": 128,
      "max_len": 128,
      "moe_every": 2,
      "dtype": "float32",
      # A few hundred steps neither overfit nor let LAMB grow BERT's 0.02 embeddings far enough.
      "dropout": 0.0,
      "embed_init_std": 0.1,
      # Megatron tensor parallelism of the dense parts over 'gpu'; Lina's prioritised gradient all-reduce.
      "tensor_parallel": False,
      "grad_sync": "default",
      # FSDP of the dense parameters over the data-parallel devices; what each block's backward recomputes.
      "fsdp": False,
      "remat": "none",
    }
  )
  # Every MoEConfig field but d_model and d_ff (the trainer takes them from model.*), at its default unless set here.
  config.moe = moe_section(
    omit=("d_model", "d_ff"),
    num_experts=8,
    top_k=1,
    num_nodes=config.mesh.nodes,  # a copy: bilevel / node_limited check it
    capacity_factor=2.0,
  )  # SMILE's; None (--config.moe.capacity_factor=None): dropless
  config.data = ml_collections.ConfigDict(
    {
      # comma-separated globs of .jsonl/.json[.gz] (C4), .parquet or .array_record files; '' = embedded corpus
      "train_files": "",
      "tokenizer_model": "",  # a SentencePiece model or a tokenizer.json; '' = train one on the corpus and cache it
      "cache_dir": "",  # where trained tokenizers and the embedded corpus are cached; '' = workdir/cache
      "tokenizer_train_chars": 2_000_000,
      "shards": 8,  # the corpus is split into this many shards (a multiple of the process count; moejax.data.pipeline)
      "mask_prob": 0.15,
      "prefetch": 2,
      "heldout_every": 50,  # every 50th document of each file held out of training for eval (0: none held out)
    }
  )
  config.optim = ml_collections.ConfigDict(
    {
      "name": "lamb",  # SMILE's; 'adamw' or 'muon' (moejax.train.optim)
      "learning_rate": 5e-3,
      "warmup_steps": 20,
      "decay": "linear",
      "decay_steps": 0,  # the schedule's length; 0 = steps (set it to stop a run early on the same schedule)
      "end_fraction": 0.1,
      "b1": 0.9,
      "b2": 0.999,
      "eps": 1e-6,
      "weight_decay": 0.01,
      "clip_norm": 1.0,
      # None: the parameters updated in their own dtype; 'float32': an fp32 master copy in the optimizer state.
      # (Untyped references, like the moe section's fields that may be None, so the command line sets either.)
      "master_dtype": ml_collections.FieldReference(None, field_type=object),
      # None: the dtype of what is updated (the master or the parameters); 'float32' or 'bfloat16'.
      "moment_dtype": ml_collections.FieldReference(None, field_type=object),
    }
  )
  # Resuming a workdir whose config.json differs (moejax.train.resume): 'same' refuses, 'continue' accepts the new
  # config (config.json keeps the history), 'branch' copies the run into branch_dir and continues there.
  config.checkpoint = ml_collections.ConfigDict(
    {"every_steps": 100, "keep": 3, "use_async": True, "resume": "same", "branch_dir": ""}
  )
  # eval_every: the loss on eval_batches micro-batches of held-out documents (data.heldout_every) after every
  # eval_every-th step and the last (0: none; moejax.train.heldout).
  config.log = ml_collections.ConfigDict({"every_steps": 25, "tensorboard": True, "eval_every": 50, "eval_batches": 4})
  # A step whose loss or gradient norm is not finite is skipped (nothing updated); max_nonfinite_steps skipped steps in
  # a row stop the run (0: never). loss_spike_factor k > 1 also skips a step whose loss exceeds k x the median of the
  # last 16 applied steps' losses (0: off). (moejax.train.guard)
  config.train = ml_collections.ConfigDict({"max_nonfinite_steps": 5, "loss_spike_factor": 0.0})
  if size == "tiny":
    return config

  layers, d, heads, f, per_gpu = SIZES[size]
  config.steps = C4_STEPS
  config.batch_size = 16384
  config.mesh.update(nodes=16, gpus_per_node=8)
  config.micro_batches = config.batch_size // (per_gpu * 128)
  config.model.update(
    vocab_size=32128,
    num_layers=layers,
    d_model=d,
    num_heads=heads,
    d_ff=f,
    dtype="bfloat16",
    dropout=0.1,
    embed_init_std=0.02,
  )
  # Worst-case receive buffers would be 2-3 GiB per hop per GPU here (experiments/exchange_memory.py);
  # 2x the local rows (NVIDIA's DeepSeek recipe) with on_overflow='retry' keeps training exact.
  config.moe.update(
    num_experts=128, collective="ragged", dtype="bfloat16", buffer_factor=2.0, num_nodes=config.mesh.nodes
  )
  config.data.update(tokenizer_train_chars=100_000_000, shards=128, prefetch=4)
  config.optim.update(learning_rate=1e-3, warmup_steps=2000, end_fraction=0.0)  # lr from SMILE's grid
  config.checkpoint.update(every_steps=1000)
  config.log.update(every_steps=50, eval_every=1000, eval_batches=1)
  return config
