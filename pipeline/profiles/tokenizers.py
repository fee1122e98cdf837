"""Tokenizer backends a profile can sit on: a `tokenizers` tokenizer.json, or a tiktoken rank file.

Both encode special-token strings found in text as their special ids and never
let BPE merge across one: text is cut at every special string first and each
piece between them is encoded on its own. That is what the target's own
tokenizer does when an engine tokenizes a rendered prompt, so ids built here
equal the ids the engine was given.

``encode(text, specials)`` honours only the special strings in ``specials``
(cut there, encoded as their ids); any other special string is ordinary text,
tokenized the way the model writes such a string when it is not the token
(``encode_ordinary``). ``specials=None`` honours all of them.
"""

from __future__ import annotations

import base64
import re
import unicodedata
from collections.abc import Callable, Collection, Iterator, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import tiktoken


@lru_cache(maxsize=64)
def special_splitter(specials: frozenset[str]) -> re.Pattern[str] | None:
    """A pattern whose ``split`` keeps each of ``specials`` as its own piece (odd indices); longest first."""
    if not specials:
        return None
    alternatives = sorted(specials, key=lambda t: (-len(t), t))
    return re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")


def encode_honouring(text: str, specials: Collection[str], ids_of: Mapping[str, int],
                     ordinary: Callable[[str], list[int]]) -> list[int]:
    """Cut ``text`` at the special strings in ``specials`` (their ids), the pieces between as ordinary text."""
    splitter = special_splitter(frozenset(specials))  # a string not in ids_of raises KeyError where it occurs
    if splitter is None:
        return ordinary(text) if text else []
    ids: list[int] = []
    for k, piece in enumerate(splitter.split(text)):
        if k % 2:
            ids.append(ids_of[piece])
        elif piece:
            ids += ordinary(piece)
    return ids


def normalize_honouring(text: str, specials: Collection[str], norm: Callable[[str], str]) -> str:
    """``norm`` applied to each piece between the honoured special strings (what encode-then-decode gives)."""
    splitter = special_splitter(frozenset(specials))
    if splitter is None:
        return norm(text)
    return "".join(p if k % 2 else norm(p) for k, p in enumerate(splitter.split(text)))


def plain_copy(tok: Any) -> Any:
    """A `tokenizers.Tokenizer` over the same model, normalizer, pre-tokenizer and decoder as ``tok`` and no added
    tokens: every string is text to it. It shares the loaded model (a reference, not a copy), so it costs
    nothing, where building it from the file again took ~0.8 s of each stage actor's start for DeepSeek."""
    from tokenizers import Tokenizer

    plain = Tokenizer(tok.model)
    plain.normalizer, plain.pre_tokenizer, plain.decoder = tok.normalizer, tok.pre_tokenizer, tok.decoder
    return plain


class HFTokenizer:
    """A `tokenizers` tokenizer.json: added tokens are matched before BPE, never merged across."""

    def __init__(self, tokenizer_file: str | Path) -> None:
        from tokenizers import Tokenizer

        self._file = Path(tokenizer_file)
        if not self._file.is_file():
            raise FileNotFoundError(f"{self._file}: no such file")
        try:
            self._tok = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on any malformed file
            raise ValueError(f"{self._file}: not a readable tokenizer.json ({e})") from None
        self._plain: Tokenizer | None = None
        self._added: dict[str, int] | None = None
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, specials: Collection[str] | None = None) -> list[int]:
        """Ids for text; ``specials`` limits which added-token strings are cut out as their ids (None: all)."""
        if specials is None:
            return self._tok.encode(text, add_special_tokens=False).ids
        if self._added is None:
            self._added = self.added_tokens()
        return encode_honouring(text, specials, self._added, self.encode_ordinary)

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids for text with no added token matched: the same tokenizer with its added tokens left out."""
        if self._plain is None:
            self._plain = plain_copy(self._tok)
        return self._plain.encode(text, add_special_tokens=False).ids

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

    def normalize(self, text: str, specials: Collection[str] | None = None) -> str:
        """The text that decoding this tokenizer's encoding of ``text`` gives back (its normalizer applied)."""
        norm = self._tok.normalizer
        if norm is None:
            return text
        if specials is None:
            return norm.normalize_str(text)
        return normalize_honouring(text, specials, norm.normalize_str)


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
    ``max_run`` reproduces Kimi's cutting of long (non-)whitespace runs; ``max_chars`` Kimi's cutting of the
    whole text into chunks of that many characters before anything else (special strings included: one cut
    through by a chunk boundary is text, as it is there).
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
        max_chars: int | None = None,
    ) -> None:
        self._enc = tiktoken.Encoding(
            name, pat_str=pat_str, mergeable_ranks=dict(ranks), special_tokens=dict(special_tokens)
        )
        self._special = dict(special_tokens)
        self._special_by_id = {i: t for t, i in self._special.items()}
        self._all_specials = frozenset(self._special)
        self._nfc = nfc
        self._max_run = max_run
        self._max_chars = max_chars
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

    def _chunks(self, text: str) -> list[str]:
        """The text cut every ``max_chars`` characters (the whole text when unset or shorter)."""
        n = self._max_chars
        if n is None or len(text) <= n:
            return [text]
        return [text[i : i + n] for i in range(0, len(text), n)]

    def encode(self, text: str, specials: Collection[str] | None = None) -> list[int]:
        """Ids for text; ``specials`` limits which special strings are cut out as their ids (None: all)."""
        honoured = self._all_specials if specials is None else specials
        return [i for chunk in self._chunks(text)
                for i in encode_honouring(chunk, honoured, self._special, self._encode_piece)]

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids for text with every special string in it treated as ordinary text."""
        return [i for chunk in self._chunks(text) if chunk for i in self._encode_piece(chunk)]

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids), errors="replace")

    def token_to_id(self, token: str) -> int:
        if token not in self._special:
            raise KeyError(f"token {token!r} is not a special token of this tokenizer")
        return self._special[token]

    def added_tokens(self) -> dict[str, int]:
        return dict(self._special)

    def normalize(self, text: str, specials: Collection[str] | None = None) -> str:
        """The text that decoding this tokenizer's encoding of ``text`` gives back (``specials`` as for encode)."""
        if not self._nfc:
            return text
        honoured = self._all_specials if specials is None else specials
        return "".join(normalize_honouring(chunk, honoured, lambda t: unicodedata.normalize("NFC", t))
                       for chunk in self._chunks(text))
