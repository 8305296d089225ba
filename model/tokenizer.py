"""GPT-2's byte-level BPE tokenizer, through the `tokenizers` library.

Byte-level BPE (Radford et al. 2019, section 2.2) maps every UTF-8 byte to a symbol first, so any text
encodes without unknown tokens and decodes back to itself. `<|endoftext|>` (id 50256) ends documents.
"""

from __future__ import annotations

import codecs
import json
import re
from itertools import groupby
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from .json_file import clip

EOT = "<|endoftext|>"
EOT_ID = 50256
# Where GPT-2's text can be cut (`Tokenizer.cut`): before the last character of a run of white space (the
# pre-tokenizer's `\s`, Unicode's White_Space) that a character other than white space follows (Python's
# `\S`: its `\s` holds every White_Space character and U+001C-U+001F besides), unless that character is
# `<` (which may open `<|endoftext|>`) and the run is longer than one.
_WHITE_SPACE = "\t-\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_CUT = re.compile(f"[{_WHITE_SPACE}](?=[^\\s<])|(?<=\\S)[{_WHITE_SPACE}](?=<)")


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
        spec = tok.to_str()  # ~2 MB of JSON for GPT-2's: made once
        self._plain = _HFTokenizer.from_str(spec)  # same vocabulary, special tokens read as text
        self._plain.encode_special_tokens = True
        eot = tok.token_to_id(EOT)
        if eot is None:
            raise TokenizerError(f"the tokenizer has no {EOT} token")
        self.eot_id: int = eot
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self._cuttable = _splits_as_gpt2(json.loads(spec))
        self.most_bytes_a_token: int | None = self._most_bytes_a_token()  # 256 for GPT-2's (20 ms)

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        directory = Path(directory)
        files = tokenizer_files(directory)
        if files is None:
            raise TokenizerError(f"no tokenizer in {directory}: expected tokenizer.json, or vocab.json and merges.txt")
        try:
            if files == ["tokenizer.json"]:
                # read here: the library's from_file takes only paths that are valid UTF-8
                return cls(_HFTokenizer.from_str((directory / "tokenizer.json").read_text(encoding="utf-8")))
            return cls(_byte_level_bpe(directory / "vocab.json", directory / "merges.txt"))
        except TokenizerError:
            raise
        except Exception as e:  # the library raises plain Exceptions with Rust messages
            raise TokenizerError(f"cannot read the tokenizer in {directory}: {e}") from None

    def _most_bytes_a_token(self) -> int | None:
        """At least as many bytes of text as any one token stands for (its vocabulary string's UTF-8 length,
        which a byte-level piece, a character for each byte, can only exceed): a text of more than n times as
        many bytes is more than n tokens. None but for a tokenizer that splits text as GPT-2's does (no
        normalizer, no truncation, no added token that swallows the spaces beside it)."""
        if not self._cuttable:
            return None
        pieces = (self._tok.id_to_token(i) for i in range(self.vocab_size))
        return max(len(piece.encode("utf-8")) for piece in pieces if piece is not None)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """The token ids of `text` (`special`: "<|endoftext|>" in it is the special token, else its characters)."""
        if not isinstance(text, str):
            raise TypeError(f"a tokenizer encodes text (a str), not {type(text).__name__}")
        check_unicode(text)
        return (self._tok if special else self._plain).encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], special: bool = True) -> list[list[int]]:
        """Like `encode` for each text. Unlike `encode`, the library releases the GIL while it works, so
        a long text encoded on another thread does not stall this process's other threads."""
        for i, text in enumerate(texts):
            check_unicode(text, i)
        tok = self._tok if special else self._plain
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    def cut(self, text: str, lo: int, hi: int) -> int:
        """The last place in `text` after `lo` and at most `hi` where it can be cut so that its two sides,
        encoded each on its own, give the ids of the whole; 0 where there is none (and always with a
        tokenizer that does not split text as GPT-2's does).

        GPT-2's pre-tokenizer splits text (around `<|endoftext|>`) into pieces with the regular expression

            's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+

        and BPE merges only within a piece, and matching from a place reads only the text after it. No piece
        runs from a character that is not white space into the white space after it, and a run of white space
        that a character other than white space follows splits into the run but its last character
        (`\\s+(?!\\S)`, which a text that ends there matches too) and that last character, alone or opening the
        next piece (` cat`, ` 42`, `\\n(`). So the text can be cut before that last character: each side splits
        into the whole's pieces. Not where a longer run ends at `<|endoftext|>`: that ends its piece of text,
        so the whole run is one piece there."""
        if not self._cuttable:
            return 0
        end = min(len(text), hi + 2)  # the white space at hi and the character after it
        width = 256
        while True:  # look back from hi, further each time
            start = max(lo - 1, hi - width, 0)
            last = 0
            for m in _CUT.finditer(text, start, end):  # (?<=\S) still sees the character before `start`
                if lo < m.start() <= hi:
                    last = m.start()
            if last or start == max(lo - 1, 0):
                return last
            width *= 8

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; an id past the tokenizer's vocabulary (a model's padded one) is `<|id:N|>`, as in
        `token_text`, where the library would leave it out. A negative id is a ValueError."""
        _no_negative(ids)
        if not ids or max(ids) < self.vocab_size:
            return self._tok.decode(ids, skip_special_tokens=False)
        runs = groupby(ids, key=lambda i: i < self.vocab_size)
        return "".join(
            self._tok.decode(list(run), skip_special_tokens=False) if known else "".join(map(self.token_text, run))
            for known, run in runs
        )

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        """Like `decode` for each list of ids; like `encode_batch`, it lets go of the GIL while it works."""
        for ids in batch:
            _no_negative(ids)
        if any(ids and max(ids) >= self.vocab_size for ids in batch):
            return [self.decode(ids) for ids in batch]
        return self._tok.decode_batch(batch, skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """The text one token stands for on its own (a lone piece of a multi-byte character shows as U+FFFD);
        `<|id:N|>` for an id past the tokenizer's vocabulary (a model's vocabulary padded past it, as nanoGPT
        pads to 50304), which would otherwise show as nothing."""
        _no_negative([token_id])
        if token_id >= self.vocab_size:
            return f"<|id:{token_id}|>"
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_name(self, token_id: int) -> str:
        """A name for one token that no other token shares: its text on its own (`token_text`), but
        `bytes:\\xNN...` for a piece of a multi-byte character, whose text alone would be U+FFFD (as OpenAI's
        logprobs name such a token)."""
        text = self.token_text(token_id)  # <|id:N|> past the tokenizer's vocabulary
        if "\ufffd" not in text:
            return text
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")  # a real U+FFFD
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def piece(self, token_id: int) -> str:
        """One id's own string in the vocabulary, as transformers' `convert_ids_to_tokens` gives it: its bytes
        spelled one character a byte (a space is `Ġ`), so that no two ids share one."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return piece

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token, as the byte-level decoder gives them: a byte for each character of its
        vocabulary string, or, for an added token with a character outside that alphabet, its text's UTF-8."""
        piece = self.piece(token_id)
        try:
            return bytes(map(_UNICODE_TO_BYTE.__getitem__, piece))
        except KeyError:
            return piece.encode()

    def save(self, directory: str | Path) -> None:
        (Path(directory) / "tokenizer.json").write_text(self._tok.to_str(pretty=True), encoding="utf-8")  # any path


class Detokenizer:
    """The text of a growing list of token ids, a token at a time (a stream's text), each token's bytes decoded
    once: they go through an incremental UTF-8 decoder, which holds back only the first bytes of a character
    not yet finished (three at most) and replaces bytes that can never be one as soon as that is known, so
    that `text` is always `Tokenizer.decode` of the ids so far (with the byte-level decoder GPT-2's has: a
    tokenizer.json that names none, or another, is decoded as byte-level BPE all the same)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.settled = ""  # the text up to the character not yet finished, which no later token changes

    def add(self, token_id: int) -> None:
        if token_id < self._tokenizer.vocab_size:
            self.settled += self._utf8.decode(self._tokenizer.token_bytes(token_id))
        else:  # an id past the vocabulary (`token_text`) ends the character before it, as `decode` has it
            self.settled += self._utf8.decode(b"", final=True) + self._tokenizer.token_text(token_id)
        held = self._utf8.getstate()[0]
        if len(held) == 2 and held[0] == 0xED and held[1] >= 0xA0:  # a surrogate's, never a character in UTF-8:
            self.settled += self._utf8.decode(b"", final=True)  # Python's decoder holds them back all the same

    @property
    def unfinished(self) -> str:
        """The text of the last bytes, which may still become a character with the next token's: "" or U+FFFD."""
        return "\ufffd" if self._utf8.getstate()[0] else ""

    @property
    def text(self) -> str:
        """The text so far, as `decode` gives it."""
        return self.settled + self.unfinished

    def __len__(self) -> int:
        return len(self.settled) + len(self.unfinished)


def _no_negative(ids: list[int]) -> None:
    """Raise ValueError for a negative id (the library's own error is an OverflowError about Rust's u32)."""
    if ids and min(ids) < 0:
        raise ValueError(f"token id {min(ids)} is negative: ids are 0 and up")


def check_unicode(text: str, item: int = 0) -> None:
    """Raise `InvalidTextError` if `text` (number `item` of a batch) is not valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidTextError(item, e.start, text[e.start]) from None


def _splits_as_gpt2(spec: dict[str, Any]) -> bool:
    """Whether the tokenizer whose tokenizer.json is `spec` splits text as GPT-2's does (what `Tokenizer.cut`
    relies on): no normalizer, the byte-level pre-tokenizer with GPT-2's regular expression and no space
    added in front, no added token but those that open with `<` (a run of white space before one is a piece
    of its own: the cut's rule keeps away from `<`), none with white space in it or that takes the white
    space beside it (`lstrip`, `rstrip`), and no truncation or padding (which would apply to each side)."""
    pre = spec.get("pre_tokenizer") or {}
    return (
        spec.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", True)
        and spec.get("truncation") is None
        and spec.get("padding") is None
        and all(
            t.get("content", "").startswith("<")
            and not re.search(r"\s", t["content"])
            and not t.get("lstrip")
            and not t.get("rstrip")
            for t in spec.get("added_tokens", [])
        )
    )


def _byte_level_bpe(vocab_path: Path, merges_path: Path) -> _HFTokenizer:
    """Build the GPT-2 tokenizer from OpenAI's `encoder.json` / `vocab.bpe` (as `vocab.json` / `merges.txt`)."""
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    merges = []
    for number, line in enumerate(merges_path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("#version") or not line.strip():
            continue
        pair = line.split(" ")
        if len(pair) != 2 or not all(pair):  # a file cut short, say, mid-line
            got = clip(line)
            raise TokenizerError(f"{merges_path}, line {number}: a merge is two symbols and one space, got {got}")
        merges.append((pair[0], pair[1]))
    made = {a + b for a, b in merges}  # every token of more than one byte is some merge's, but special tokens
    unmade = [(i, t) for t, i in vocab.items() if len(t) > 1 and t not in made and not _special(t)]
    if unmade:
        i, t = min(unmade)
        raise TokenizerError(
            f"{merges_path}: no merge makes {len(unmade)} of vocab.json's tokens (the first {t!r}, id {i}), so "
            "no text would encode to them: the file is cut short, or another tokenizer's"
        )
    tok = _HFTokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    if EOT in vocab:
        tok.add_special_tokens([EOT])
    return tok


def _special(token: str) -> bool:
    """Whether a vocabulary's token is spelled as GPT-2's special ones are, `<|endoftext|>`, `<|pad|>`."""
    return token.startswith("<|") and token.endswith("|>")


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
