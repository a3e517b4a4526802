"""megatron-core 0.16.1 on CPU with gloo: the few things it assumes of a CUDA device, and what is done instead.

Applied by :func:`apply` only where CUDA is absent (``torch.cuda.is_available()`` False); on a GPU
megatron-core is used as it ships, but for the MoE router's name below, which is about Transformer
Engine being absent, not CUDA.

* **Device lookup.** megatron-core allocates buffers with ``device=torch.cuda.current_device()``
  (rotary frequencies, token dispatcher counts, tensor-parallel gathers). On a CPU-only torch that call
  raises; here it returns the CPU device, so those tensors land where the model is.
* **RNG tracker.** The default tracker forks and restores CUDA generator states around every
  tensor-parallel initialization and dropout (``get_cuda_rng_tracker().fork()``), which needs CUDA.
  :func:`init_rng_tracker` selects megatron-core's inference tracker (``inference_rng_tracker=True``), whose
  ``fork`` is a no-op. Harmless here: weights are loaded from the Hugging Face checkpoint, never drawn,
  and dropout is off (the engines that sampled have none).
* **Attention mask.** The local (non-Transformer-Engine) attention takes no packed-sequence
  parameters (THD) and would need an explicit block-diagonal causal mask over the whole micro-batch. This
  backend's core attention (:mod:`rollshard.train.backends.megatron.attention`) attends within each packed
  sequence instead, on every device; megatron-core's attention with the explicit mask
  (:func:`rollshard.train.backends.megatron.forward.packed_causal_mask`) is its reference in the tests.
* **Tied embeddings over pipeline stages.** ``LanguageModule.setup_embeddings_and_output_layer`` moves the
  last stage's copy of a tied embedding with ``weight.data.cuda()`` before its all-reduce over the embedding
  group; on CPU that call is made the identity for the length of the method (the backend then loads the
  copy from the checkpoint anyway).
* **MoE router without Transformer Engine.** ``moe_utils.RouterGatingLinearFunction`` tests
  ``te_general_gemm is not None``, a name only bound when Transformer Engine imports (a NameError without it);
  :func:`apply` binds it to None, which selects the function's own ``torch.mm`` path. The alltoall token
  dispatcher creates a CUDA stream in its constructor, so on CPU the MoE layers use the allgather dispatcher
  (``rollshard.train.backends.megatron.model``).
* **Expected warnings.** Without Transformer Engine and Apex megatron-core warns at import and model build
  that it falls back to torch (norms, optimizers, multi-tensor ops); :func:`quiet` silences those few
  (:data:`EXPECTED_WARNINGS`), and only those.
* **vocab_parallel_cross_entropy** overwrites its logits argument in place (it subtracts the max and
  exponentiates into the same storage). This backend never calls it: its logprobs come from its own
  vocab-parallel log softmax (``forward.vocab_parallel_logprobs``), which also divides by each row's
  temperature and gives the entropy. :func:`cross_entropy` is a safe wrapper for anyone who needs the
  library's function here (it passes a copy).
"""

from __future__ import annotations

import warnings

import torch

_APPLIED = False
# Warnings megatron-core gives on every start without Transformer Engine / Apex (the CPU path by design) and for
# torch collectives it calls by their deprecated names: silenced, so a run's stderr holds what concerns it.
EXPECTED_WARNINGS = (
    (UserWarning, r"(Transformer Engine and Apex are|Apex is) not installed"),
    (UserWarning, r"full scope is deprecated"),
    (UserWarning, r"When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE"),
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"),
)


def quiet() -> None:
    """Silence :data:`EXPECTED_WARNINGS` (before megatron-core is imported: most are given at import)."""
    for category, message in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def cpu_only() -> bool:
    return not torch.cuda.is_available()


def apply() -> None:
    """The router's missing name wherever Transformer Engine is absent; the CPU patches where CUDA is (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # its torch.mm fallback
    if not cpu_only():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # megatron-core allocates on it
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    def setup_on_cpu(self, *args, **kwargs):
        to_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # the tensor stays on the CPU
        try:
            return setup(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = to_cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu


def init_rng_tracker() -> None:
    """The inference RNG tracker on CPU (no CUDA generator states to fork); the default one on GPUs, seeded."""
    from megatron.core.tensor_parallel.random import initialize_rng_tracker, model_parallel_cuda_manual_seed

    if cpu_only():
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:
        model_parallel_cuda_manual_seed(0)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``vocab_parallel_cross_entropy`` without touching ``logits`` (it works in place on its input)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits.clone(), target)
