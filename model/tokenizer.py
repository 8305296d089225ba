"""GPT-2's byte-level BPE tokenizer, through the `tokenizers` library.

Byte-level BPE (Radford et al. 2019, section 2.2) maps every UTF-8 byte to a symbol first, so any text
encodes without unknown tokens and decodes back to itself. `<|endoftext|>` (id 50256) ends documents.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

EOT = "<|endoftext|>"
EOT_ID = 50256


class TokenizerError(ValueError):
    """Tokenizer files that are missing or unreadable."""


class InvalidTextError(ValueError):
    """Text that is not valid Unicode: it holds a lone surrogate (half of a UTF-16 pair, as JSON's
    `"\\udc80"` can give), which has no UTF-8 bytes, so byte-level BPE cannot encode it. `item` is the
    text's place in a batch, `index` the surrogate's place in the text."""

    def __init__(self, item: int, index: int, char: str) -> None:
        super().__init__(f"not valid Unicode: it holds a lone surrogate (U+{ord(char):04X}) at character {index}")
        self.item, self.index = item, index


def tokenizer_files(directory: Path) -> list[str] | None:
    """The tokenizer files a directory holds, in the order we prefer them, or None if it holds none."""
    if (directory / "tokenizer.json").is_file():
        return ["tokenizer.json"]
    if (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        return ["vocab.json", "merges.txt"]
    return None


class Tokenizer:
    """Text <-> GPT-2 token ids. `<|endoftext|>` in text becomes id 50256 unless `special=False`."""

    def __init__(self, tok: _HFTokenizer) -> None:
        self._tok = tok
        self._plain = _HFTokenizer.from_str(tok.to_str())  # same vocabulary, special tokens read as text
        self._plain.encode_special_tokens = True
        eot = tok.token_to_id(EOT)
        if eot is None:
            raise TokenizerError(f"the tokenizer has no {EOT} token")
        self.eot_id: int = eot
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        directory = Path(directory)
        files = tokenizer_files(directory)
        if files is None:
            raise TokenizerError(f"no tokenizer in {directory}: expected tokenizer.json, or vocab.json and merges.txt")
        try:
            if files == ["tokenizer.json"]:
                return cls(_HFTokenizer.from_file(str(directory / "tokenizer.json")))
            return cls(_byte_level_bpe(directory / "vocab.json", directory / "merges.txt"))
        except TokenizerError:
            raise
        except Exception as e:  # the library raises plain Exceptions with Rust messages
            raise TokenizerError(f"cannot read the tokenizer in {directory}: {e}") from None

    def encode(self, text: str, special: bool = True) -> list[int]:
        check_unicode(text)
        return (self._tok if special else self._plain).encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], special: bool = True) -> list[list[int]]:
        """Like `encode` for each text. Unlike `encode`, the library releases the GIL while it works, so
        a long text encoded on another thread does not stall this process's other threads."""
        for i, text in enumerate(texts):
            check_unicode(text, i)
        tok = self._tok if special else self._plain
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        """Like `decode` for each list of ids; like `encode_batch`, it lets go of the GIL while it works."""
        return self._tok.decode_batch(batch, skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """The text one token stands for on its own (a lone piece of a multi-byte character shows as U+FFFD);
        `<|id:N|>` for an id past the tokenizer's vocabulary (a model's vocabulary padded past it, as nanoGPT
        pads to 50304), which would otherwise show as nothing."""
        if token_id >= self.vocab_size:
            return f"<|id:{token_id}|>"
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        if piece == EOT:
            return piece.encode()
        return bytes(_UNICODE_TO_BYTE[c] for c in piece)

    def save(self, directory: str | Path) -> None:
        self._tok.save(str(Path(directory) / "tokenizer.json"))


def check_unicode(text: str, item: int = 0) -> None:
    """Raise `InvalidTextError` if `text` (number `item` of a batch) is not valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidTextError(item, e.start, text[e.start]) from None


def _byte_level_bpe(vocab_path: Path, merges_path: Path) -> _HFTokenizer:
    """Build the GPT-2 tokenizer from OpenAI's `encoder.json` / `vocab.bpe` (as `vocab.json` / `merges.txt`)."""
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    merges = []
    for line in merges_path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#version") or not line.strip():
            continue
        a, b = line.split(" ")
        merges.append((a, b))
    tok = _HFTokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    if EOT in vocab:
        tok.add_special_tokens([EOT])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the alphabet of byte-level BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
