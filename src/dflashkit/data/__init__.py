"""Training data for the drafter: prompt sources, chat rendering with the target's own template, and
`dflashkit prepare`, which has the target regenerate the replies and writes a tokenized dataset folder.

- `sources`: read prompts (chat JSONL, ShareGPT, prompt lists, chitchat, MT-Bench); select, de-duplicate
  and split them deterministically.
- `chat`: render conversations with the tokenizer's chat template; the loss mask on assistant tokens;
  `template_identity`, the record that proves training, evaluation and serving use the same template.
- `regenerate`: load the target with plain transformers and generate replies in left-padded batches,
  cached in an append-only file that a restart resumes from.
- `dataset`: `prepare_dataset(settings)`, and `load_dataset`/`read_manifest` for training.
- `rows`: the packed rows training, evaluation and `dflashkit capture` read; `stream`: the one order
  (micro-batches of each epoch's seeded permutation) in which every placement trains on them.
- `features`: `dflashkit capture`'s feature folders, and reading them back.

This package imports nothing heavy at import time (the command line loads it on every start).
"""
