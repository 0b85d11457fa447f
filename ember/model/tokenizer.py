"""Tokenizer: a `tokenizers` BPE plus the model's jinja2 chat template."""
from __future__ import annotations

import json
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _raise_exception(message: str):
    raise TemplateError(message)


class Tokenizer:
    def __init__(self, backend: HFTokenizer, chat_template: str | None,
                 bos_token: str | None, eos_token: str | None):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self._template = None
        self._byte_level = json.loads(backend.to_str()).get("decoder", {}).get("type") == "ByteLevel"
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(chat_template)

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        folder = Path(folder)
        backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        return cls(backend, template, _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token")))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # Special tokens written in the text (e.g. by the chat template) are kept as such.
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI logprobs' `bytes`): a byte-level BPE piece mapped
        back through GPT-2's byte alphabet; a special token's own text."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(ch in _UNICODE_TO_BYTE for ch in piece):
            return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
        return piece.encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; send plain text instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] needs 'role' and 'content'")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_TO_BYTE = _byte_alphabet()


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):  # older tokenizer_config.json stores AddedToken dicts
        return tok.get("content")
    return tok
