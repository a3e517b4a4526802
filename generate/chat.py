"""How chat messages become the prompt text sent to the engine: ``--chat-template``, ``--no-chat-template``.

Three ways, one per run, recorded in the run config (:meth:`ChatFormat.config`: the mode,
the template text actually used and its hash):

* ``tokenizer`` (the default): the tokenizer's own chat template, with the generation prompt;
* ``file``: a Jinja chat template read from ``--chat-template PATH`` (same variables as
  transformers' templates: ``messages``, ``add_generation_prompt``, the special tokens);
* ``raw`` (``--no-chat-template``): no template; the prompt is the messages' contents joined by
  a blank line (a system prompt first), for base models and completion-style tasks.

The rendered text is encoded without special tokens (store/models/tokenizer.py), in every mode.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Sequence

from rollshard.store.models.tokenizer import Message, TokenizerError, encode, render_chat

RAW_SEPARATOR = "\n\n"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatFormat:
    mode: str = "tokenizer"  # tokenizer | file | raw
    template: str | None = None  # the Jinja text (mode "file")
    path: str | None = None  # where it was read from (mode "file")

    @classmethod
    def from_file(cls, path: str) -> "ChatFormat":
        p = Path(path).expanduser()
        try:
            text = p.read_text()
        except OSError as e:
            raise ValueError(f"--chat-template {path}: cannot read it ({e.strerror or e})") from e
        if not text.strip():
            raise ValueError(f"--chat-template {path}: the file is empty")
        return cls(mode="file", template=text, path=str(p.resolve()))

    def render(self, tokenizer, messages: Sequence[Message]) -> str:
        if self.mode == "raw":
            return RAW_SEPARATOR.join(str(m["content"]) for m in messages)
        if self.mode == "file":
            try:
                return tokenizer.apply_chat_template(
                    list(messages), chat_template=self.template, tokenize=False, add_generation_prompt=True
                )
            except Exception as e:  # a Jinja error in the user's template
                raise TokenizerError(f"--chat-template {self.path}: {type(e).__name__}: {e}") from e
        return render_chat(tokenizer, messages)

    def ids(self, tokenizer, messages: Sequence[Message]) -> list[int]:
        return encode(tokenizer, self.render(tokenizer, messages))

    def config(self, tokenizer) -> dict[str, Any]:
        """The run config's record: the mode and the template text used (None for raw) with its sha256."""
        template = self.template if self.mode == "file" else None
        if self.mode == "tokenizer":
            template = getattr(tokenizer, "chat_template", None)
            template = template if isinstance(template, str) else None
        digest = hashlib.sha256(template.encode()).hexdigest() if template else None
        return {"mode": self.mode, "path": self.path, "sha256": digest, "template": template}
