"""Tokenizer backends a profile can sit on: a `tokenizers` tokenizer.json, or a tiktoken rank file.

Both encode special-token strings found in text as their special ids and never
let BPE merge across one: text is cut at every special string first and each
piece between them is encoded on its own. That is what the target's own
tokenizer does when an engine tokenizes a rendered prompt, so ids built here
equal the ids the engine was given.
"""

from __future__ import annotations

import base64
import re
import unicodedata
from collections.abc import Iterator, Mapping
from pathlib import Path

import tiktoken


class HFTokenizer:
    """A `tokenizers` tokenizer.json: added tokens are matched before BPE, never merged across."""

    def __init__(self, tokenizer_file: str | Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tokenizer_file))
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise KeyError(f"token {token!r} is not in the tokenizer vocabulary")
        return tid

    def added_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}

    def normalize(self, text: str) -> str:
        """The text that decoding this tokenizer's encoding of ``text`` gives back (its normalizer applied)."""
        norm = self._tok.normalizer
        return norm.normalize_str(text) if norm is not None else text


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """A tiktoken rank file: one ``base64(token) rank`` pair per line."""
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def split_long_runs(text: str, max_run: int) -> Iterator[str]:
    """Cut text so no piece holds more than ``max_run`` consecutive (non-)whitespace characters.

    Kimi's tokenizer does this before BPE (tiktoken's Rust core is quadratic, and
    panics, on very long runs); cutting at the same places keeps ids identical.
    """
    start = 0
    run = 0
    space = text[:1].isspace()
    for i, ch in enumerate(text):
        now = ch.isspace()
        if now != space:
            space, run = now, 1
            continue
        run += 1
        if run > max_run:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]


class TiktokenTokenizer:
    """A tiktoken rank file with a pre-tokenizer pattern and special tokens at fixed ids.

    ``nfc`` applies Unicode NFC to each text piece (Qwen's tokenizer.json does);
    ``max_run`` reproduces Kimi's cutting of long (non-)whitespace runs.
    """

    def __init__(
        self,
        ranks: Mapping[bytes, int],
        pat_str: str,
        special_tokens: Mapping[str, int],
        *,
        name: str = "tiktoken",
        nfc: bool = False,
        max_run: int | None = None,
    ) -> None:
        self._enc = tiktoken.Encoding(
            name, pat_str=pat_str, mergeable_ranks=dict(ranks), special_tokens=dict(special_tokens)
        )
        self._special = dict(special_tokens)
        self._special_by_id = {i: t for t, i in self._special.items()}
        # Longest first, so a special string that is a prefix of another never wins.
        alternatives = sorted(self._special, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None
        self._nfc = nfc
        self._max_run = max_run
        self.n_base = len(ranks)
        self.vocab_size = self._enc.n_vocab

    def _encode_piece(self, text: str) -> list[int]:
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        if self._max_run is None:
            return self._enc.encode_ordinary(text)
        out: list[int] = []
        for part in split_long_runs(text, self._max_run):
            out += self._enc.encode_ordinary(part)
        return out

    def encode(self, text: str) -> list[int]:
        if self._special_re is None:
            return self._encode_piece(text)
        ids: list[int] = []
        for k, piece in enumerate(self._special_re.split(text)):
            if k % 2:
                ids.append(self._special[piece])
            elif piece:
                ids += self._encode_piece(piece)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids), errors="replace")

    def token_to_id(self, token: str) -> int:
        if token not in self._special:
            raise KeyError(f"token {token!r} is not a special token of this tokenizer")
        return self._special[token]

    def added_tokens(self) -> dict[str, int]:
        return dict(self._special)

    def normalize(self, text: str) -> str:
        """The text that decoding this tokenizer's encoding of ``text`` gives back."""
        if not self._nfc or self._special_re is None:
            return unicodedata.normalize("NFC", text) if self._nfc else text
        pieces = self._special_re.split(text)
        return "".join(p if k % 2 else unicodedata.normalize("NFC", p) for k, p in enumerate(pieces))
