"""The consistency lens: what a pair's two prompts differ by, and where on a response the clean-prompt teacher and
the student disagree, token by token.

  diff.py     the token difference of a pair's two rendered prompts, and whether the perturbation only adds text
  tokens.py   token logs of training: a step's samples with their per-token student and teacher log-probs (Parquet)
  viewer.py   the static HTML viewer of those logs, of a check and of the evaluations' answers side by side
  check.py    `opct check`: the pre-flight check of a pairs file on a model, before any training
"""
