"""The tokenizer helper shared by generate and train: load a model folder's tokenizer, chat messages -> ids.

Generation and training must tokenize the same way, so both go through here. The
chat template is rendered to text and then encoded without adding special tokens:
the template already writes every marker, and encoding the text (rather than
transformers' ``apply_chat_template(tokenize=True)``, whose return type changed
between transformers 4 and 5) gives the same ids on both major versions.

Loading is offline (``local_files_only``): a model folder must hold its tokenizer, and
a tokenizer without a vocabulary (what transformers 5.x builds for a folder lacking
tokenizer files) is refused when it is loaded.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Sequence

Message = dict[str, Any]  # {"role": ..., "content": ...}


class TokenizerError(ValueError):
    """A tokenizer could not be loaded, has no vocabulary or has no chat template."""


# Any real tokenizer encodes this to at least one id; one that does not has no vocabulary to speak of.
PROBE_TEXT = "Hello world 123"


@functools.lru_cache(maxsize=16)
def _load(path: str):
    from transformers import AutoTokenizer

    how = "pass a model folder holding tokenizer.json, e.g. one built by `rollshard-generate init-model PATH`"
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot load a tokenizer from {path!r} ({e.__class__.__name__}); {how}") from e
    # transformers 5.x builds an empty tokenizer (special tokens only) for a folder without tokenizer files
    # instead of raising; every request would then fail later with "empty input_ids".
    if len(tok) == 0 or not tok.encode(PROBE_TEXT, add_special_tokens=False):
        raise TokenizerError(
            f"no tokenizer vocabulary in {path!r}: the tokenizer loaded from it encodes {PROBE_TEXT!r} to no ids "
            f"(are its tokenizer files missing?); {how}"
        )
    return tok


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a local model folder (cached per resolved path)."""
    return _load(str(Path(path).expanduser().resolve()))


class Decoder:
    """Token ids -> text from a folder's ``tokenizer.json`` alone, through the ``tokenizers`` library: what the
    report and ``inspect`` need, without importing transformers (~2 s on 2 cores). It decodes as transformers'
    fast tokenizer of the folder does (its ``_decode`` calls this same method; no clean-up of spaces)."""

    def __init__(self, tokenizer_json: Path):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_json))

    def batch_decode(self, ids: Sequence[Sequence[int]], *, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool = False) -> list[str]:
        if clean_up_tokenization_spaces:
            raise ValueError("Decoder does not clean up spaces; load the tokenizer with load_tokenizer for that")
        return self._tokenizer.decode_batch([list(i) for i in ids], skip_special_tokens=skip_special_tokens)


def load_decoder(path: str | os.PathLike):
    """What decodes a folder's token ids for display: its ``tokenizer.json`` through :class:`Decoder`, or (a folder
    without one, a file ``tokenizers`` cannot read) the transformers tokenizer."""
    folder = Path(path).expanduser().resolve()
    if (folder / "tokenizer.json").is_file():
        try:
            return Decoder(folder / "tokenizer.json")
        except Exception:  # the tokenizers library's own error type (a JSON it does not know): transformers may
            pass
    return load_tokenizer(folder)


def render_chat(tokenizer, messages: Sequence[Message], *, add_generation_prompt: bool = True, **kwargs) -> str:
    """The chat template applied to ``messages``, as text."""
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizerError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
            "use a chat model folder or set tokenizer.chat_template"
        )
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def apply_chat_template(
    tokenizer, messages: Sequence[Message], *, add_generation_prompt: bool = True, **kwargs
) -> list[int]:
    """Chat messages -> prompt token ids (the template's markers become their special-token ids)."""
    text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, **kwargs)
    return encode(tokenizer, text)


def encode(tokenizer, text: str) -> list[int]:
    """Plain text -> ids, adding no BOS/EOS (templates and callers add what they need).

    ``verbose=False``: transformers warns when a text is longer than the model's context; callers here check
    the length themselves and say what to do about it (the warning would only add a confusing second line)."""
    return list(tokenizer.encode(text, add_special_tokens=False, verbose=False))


def decode(tokenizer, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def eos_token_ids(tokenizer, model_path: str | os.PathLike | None = None) -> list[int]:
    """Ids that end a generation: the tokenizer's eos plus ``generation_config.json``'s ``eos_token_id``."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    folder = Path(model_path if model_path is not None else getattr(tokenizer, "name_or_path", ""))
    gen_cfg = folder / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids
