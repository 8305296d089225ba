"""The GPT-2 tokenizer against the golden encodings (computed by tiktoken and tokenizers, see
shared/gpt2-tokenizer/README.md), from both file forms, and the byte-level round trip on any text."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from model.tokenizer import EOT, EOT_ID, Tokenizer, TokenizerError, tokenizer_files


@pytest.fixture(scope="module")
def from_vocab_and_merges(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("vocab_merges")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(tokenizer_dir / name, directory / name)
    assert tokenizer_files(directory) == ["vocab.json", "merges.txt"]
    return Tokenizer.from_dir(directory)


@pytest.fixture(scope="module", params=["tokenizer.json", "vocab.json+merges.txt"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "tokenizer.json":
        return request.getfixturevalue("tokenizer")
    return request.getfixturevalue("from_vocab_and_merges")


def test_golden_encodings(tok: Tokenizer, golden: list[dict]) -> None:
    assert len(golden) == 33
    for case in golden:
        assert tok.encode(case["text"], special=case["special"]) == case["ids"], case
    batch = tok.encode_batch([c["text"] for c in golden if c["special"]], special=True)
    assert batch == [c["ids"] for c in golden if c["special"]]


def test_golden_decodings(tok: Tokenizer, golden: list[dict]) -> None:
    for case in golden:
        assert tok.decode(case["ids"]) == case["text"]


def test_vocabulary_and_special_token(tok: Tokenizer) -> None:
    assert tok.vocab_size == 50257
    assert tok.eot_id == EOT_ID == 50256
    assert tok.encode(EOT) == [EOT_ID]
    assert tok.encode(EOT, special=False) == [27, 91, 437, 1659, 5239, 91, 29]
    assert tok.encode("Hello, world!") == [15496, 11, 995, 0]


def test_token_text_and_bytes(tok: Tokenizer) -> None:
    assert tok.token_text(995) == " world"
    assert tok.token_bytes(995) == b" world"
    assert tok.token_bytes(EOT_ID) == EOT.encode()
    text = "emoji 😀 naïve"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert "\ufffd" in "".join(tok.token_text(i) for i in ids)  # pieces of one character stand alone as U+FFFD
    with pytest.raises(ValueError, match=r"token id 50257 is outside the vocabulary \(0\.\.50256\)"):
        tok.token_bytes(50257)
    # a model's vocabulary padded past the tokenizer's (nanoGPT's 50304): each id its own name, not ""
    assert [tok.token_text(i) for i in (50257, 50303)] == ["<|id:50257|>", "<|id:50303|>"]


def test_save_and_reload(from_vocab_and_merges: Tokenizer, tmp_path: Path) -> None:
    from_vocab_and_merges.save(tmp_path)
    again = Tokenizer.from_dir(tmp_path)
    text = "The end.<|endoftext|>A new document, 日本語"
    assert again.encode(text) == from_vocab_and_merges.encode(text)
    assert again.encode(text, special=False) == from_vocab_and_merges.encode(text, special=False)


def test_missing_or_broken_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"expected tokenizer\.json, or vocab\.json and merges\.txt"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"expected tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)  # merges.txt is missing
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(TokenizerError, match=f"cannot read the tokenizer in {tmp_path}"):
        Tokenizer.from_dir(tmp_path)


@settings(max_examples=300, deadline=None, database=None)
@given(text=st.text())
@example(text="a<|endoftext|>b")
@example(text="<|endoftext|><|endoftext|> <|endoftext|")
@example(text="\r\n\t \u00a0\u3000\u2028 ")
@example(text="👨‍👩‍👧‍👦🇯🇵e\u0301")
def test_round_trip_on_any_text(tokenizer: Tokenizer, text: str) -> None:
    for special in (True, False):
        ids = tokenizer.encode(text, special=special)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
        assert (EOT_ID in ids) == (special and EOT in text)
