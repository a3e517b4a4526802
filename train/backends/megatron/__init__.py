"""The ``megatron`` backend (``rollshard-train --backend megatron --tp N --pp M [--ep K]``): megatron-core's
GPTModel trained from the same loader, losses, metrics and checkpoints as the ``hf`` backend.

Modules: :mod:`.model` (Hugging Face config -> TransformerConfig and GPTModel), :mod:`.weights` (Hugging
Face <-> megatron layout, split by rank), :mod:`.forward` (packed forward, vocabulary-parallel logprobs),
:mod:`.parallel` (megatron-core's process groups, the trainer's data-parallel view), :mod:`.routing` (MoE
routing replay), :mod:`.backend` (the backend the trainer drives) and :mod:`.compat` (what megatron-core
0.16.1 needs on CPU with gloo). Needs the ``megatron`` extra (``pip install rollshard[megatron]``).
"""
