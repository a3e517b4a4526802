"""rollshard.train: GRPO from rollout shards.

The trainer streams :class:`rollshard.store.loader.Step` batches, recomputes the
current policy's logprob of every stored response token, and takes the
importance ratio against the stored rollout logprob (bypass mode) or against a
proximal policy recomputed once per step (decoupled mode).

Modules, in the order a step uses them:

* :mod:`~rollshard.train.advantages` GRPO advantages by explicit group id (pure).
* :mod:`~rollshard.train.logprobs` packed forward, chunked fp32 log softmax of
  ``logits / temperature`` gathered at the response tokens.
* :mod:`~rollshard.train.attention` varlen packed attention (``rollshard_varlen``): causal sdpa
  per sequence, no ``[T, T]`` mask.
* :mod:`~rollshard.train.losses` policy loss variants, KL, entropy (pure).
* :mod:`~rollshard.train.support` sampling-aware ratios: which logprobs the ratio takes where a
  token has a stored top-p/top-k sampling support, and their metrics (pure).
* :mod:`~rollshard.train.backends` the model, optimizer and parallelism (``hf``).
* :mod:`~rollshard.train.trainer` the loop; :mod:`~rollshard.train.checkpoint`,
  :mod:`~rollshard.train.metrics`, :mod:`~rollshard.train.config`,
  :mod:`~rollshard.train.cli`.

Shape vocabulary (used in every ``# [..]`` comment of this package):

* ``T``  packed tokens of one micro-batch: its sequences laid end to end, no padding.
* ``S``  sequences (rows) in one micro-batch; ``cu_seqlens`` ``[S+1]`` holds their
  token offsets into ``T``.
* ``N``  sequences in one step (all micro-batches of one rank together).
* ``G``  GRPO groups in one step.
* ``K``  positions selected for the loss (response tokens), ``K <= T``.
* ``V``  vocabulary size; ``H`` hidden size.

Token alignment: a per-token tensor at position ``t`` describes the token
``input_ids[t]``. Its logprob comes from the logits at ``t - 1``; positions with
``loss_mask == 0`` (prompt, tool/environment tokens) carry no loss and a logprob of 0.
"""
