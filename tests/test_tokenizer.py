"""The GPT-2 tokenizer against the golden encodings (computed by tiktoken and tokenizers, see
shared/gpt2-tokenizer/README.md), from both file forms, and the byte-level round trip on any text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from model.tokenizer import EOT, EOT_ID, Detokenizer, Tokenizer, TokenizerError, tokenizer_files


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


def test_every_token_has_a_name_of_its_own(tok: Tokenizer) -> None:
    """`token_name`: the text, but a piece of a multi-byte character by its bytes (255 ids' text alone is
    U+FFFD, which named them all alike in the CLI's tables), and `<|id:N|>` past the vocabulary."""
    names = [tok.token_name(i) for i in range(tok.vocab_size)]
    assert len(set(names)) == tok.vocab_size
    lead = next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == b"\xe2")
    assert tok.token_text(lead) == "\ufffd" and tok.token_name(lead) == "bytes:\\xe2"
    assert tok.token_name(995) == " world" and tok.token_name(50300) == "<|id:50300|>"


def test_ids_past_the_vocabulary_decode_as_their_names(tok: Tokenizer) -> None:
    """A model padded past the tokenizer's vocabulary (nanoGPT's 50304) may be given those ids in a prompt: its
    text names them as `token_text` does (the library left them out: 'Hello world'), in a batch too, and a
    character split around one decodes each side on its own."""
    assert tok.decode([15496, 50300, 995]) == "Hello<|id:50300|> world"
    assert tok.decode_batch([[15496, 50300, 995], [15496]]) == ["Hello<|id:50300|> world", "Hello"]
    emoji = tok.encode("😀")  # four bytes in more than one token
    assert len(emoji) > 1
    assert tok.decode([*emoji[:1], 50257, *emoji[1:]]) == tok.decode(emoji[:1]) + "<|id:50257|>" + tok.decode(emoji[1:])


def test_a_negative_id_is_a_value_error(tok: Tokenizer) -> None:
    """A negative id in Python is a ValueError that says so (the library's was an OverflowError about Rust's
    u32); over HTTP the ids are checked before."""
    for call in (lambda: tok.decode([15496, -1]), lambda: tok.decode_batch([[1], [-3]]), lambda: tok.token_text(-1)):
        with pytest.raises(ValueError, match=r"token id -\d is negative: ids are 0 and up"):
            call()


def test_a_folder_whose_name_is_not_utf8(tokenizer_dir: Path, tmp_path: Path) -> None:
    """A path of bytes that are not UTF-8 (as Linux allows, Python holding them as surrogates): the library's
    from_file refused it ("surrogates not allowed"), though the files are fine."""
    import os

    directory = tmp_path / os.fsdecode(b"tok\xff")
    directory.mkdir()
    shutil.copy(tokenizer_dir / "tokenizer.json", directory / "tokenizer.json")
    assert Tokenizer.from_dir(directory).encode("Hello world") == [15496, 995]
    (directory / "tokenizer.json").unlink()
    Tokenizer.from_dir(tokenizer_dir).save(directory)  # and written there
    assert Tokenizer.from_dir(directory).encode("Hello world") == [15496, 995]


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


@pytest.mark.parametrize(
    "bad", ["Ġ", "Ġ t h", "Ġ ", "Ġ  t"], ids=["cut mid-line", "three", "one and a space", "two spaces"]
)
def test_a_merges_line_that_is_not_a_pair_is_named(tokenizer_dir: Path, tmp_path: Path, bad: str) -> None:
    """A merges.txt cut short (mid-line, say) names the file, the line and what it holds, not Python's unpacking."""
    (tmp_path / "vocab.json").write_bytes((tokenizer_dir / "vocab.json").read_bytes())
    (tmp_path / "merges.txt").write_text(f"#version: 0.2\nĠ t\n{bad}\n", encoding="utf-8")
    want = f"{tmp_path / 'merges.txt'}, line 3: a merge is two symbols and one space, got {bad!r}"
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_dir(tmp_path)
    assert str(e.value) == want


@pytest.mark.parametrize("kept", [0, 1, 49999])
def test_a_merges_file_cut_at_a_line_is_refused(tokenizer_dir: Path, tmp_path: Path, kept: int) -> None:
    """A merges.txt emptied, or cut short at a line's end, parses: but the tokens of vocab.json that its missing
    merges made could never be encoded, and text would tokenize otherwise. Refused, naming the first."""
    (tmp_path / "vocab.json").write_bytes((tokenizer_dir / "vocab.json").read_bytes())
    lines = (tokenizer_dir / "merges.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    (tmp_path / "merges.txt").write_text("".join(lines[: 1 + kept]) if kept else "", encoding="utf-8")
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_dir(tmp_path)
    first = {0: "'Ġt', id 256", 1: "'Ġa', id 257", 49999: "'Ġgazed', id 50255"}[kept]
    assert str(e.value) == (
        f"{tmp_path / 'merges.txt'}: no merge makes {50000 - kept} of vocab.json's tokens (the first {first}), "
        "so no text would encode to them: the file is cut short, or another tokenizer's"
    )


def test_a_vocabulary_with_special_tokens_of_its_own_loads(tokenizer_dir: Path, tmp_path: Path) -> None:
    """A vocab.json with a special token besides <|endoftext|> (a fine-tune's <|pad|>), which no merge makes, is
    no merges.txt cut short: it loads, and decodes that token as its text."""
    vocab = json.loads((tokenizer_dir / "vocab.json").read_text(encoding="utf-8")) | {"<|pad|>": 50257}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_bytes((tokenizer_dir / "merges.txt").read_bytes())
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.decode([15496, 50257]) == "Hello<|pad|>"


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


# ids for a stream's text: single bytes (ids 0-255, which may start, continue or never be a character), pieces
# of multi-byte characters, <|endoftext|>, ids past the vocabulary, any id
STREAM_IDS = st.integers(0, 255) | st.sampled_from([5525, 6184, 27332, 47249, 171, 4210]) | st.just(EOT_ID)
STREAM_IDS |= st.integers(50257, 50303) | st.integers(0, 50256)


@settings(max_examples=300, deadline=None, database=None)
@given(ids=st.lists(STREAM_IDS, max_size=24))
@example(ids=[169, 111, 64])  # b"\xed\xb3": a surrogate's first bytes, never a character: settled at once
@example(ids=[226, 50260, 226, 226])  # half a character before an id past the vocabulary: U+FFFD, as decode has it
def test_a_stream_decodes_as_the_whole(tok: Tokenizer, ids: list[int]) -> None:
    """`Detokenizer`: the text of a growing list of ids, a token at a time, is `decode` of the ids so far at
    every step; what it has settled is never taken back."""
    stream = Detokenizer(tok)
    settled = ""
    for n in range(len(ids) + 1):
        if n:
            stream.add(ids[n - 1])
        assert stream.text == tok.decode(ids[:n]) and len(stream) == len(stream.text)
        assert stream.settled.startswith(settled) and stream.unfinished in ("", "\ufffd")
        settled = stream.settled


def test_a_stream_decodes_added_tokens_as_the_whole(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Added tokens are decoded as the library's byte-level decoder has them: through the byte alphabet where
    every character of theirs is in it ("<Ġ>" is "< >", "<Ã©>" is "<é>", and "<é>" a lone byte 0xE9: U+FFFD),
    else as their own text ("a b", "\u2039é>": the space and U+2039 are no byte's symbol)."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    added = ["<Ġ>", "<Ã©>", "<é>", "a b", "\u2039é>"]
    eot = spec["added_tokens"][0]
    spec["added_tokens"] += [{**eot, "id": 50257 + i, "content": c} for i, c in enumerate(added)]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    tok = Tokenizer.from_dir(tmp_path)
    assert [tok.decode([50257 + i]) for i in range(len(added))] == ["< >", "<é>", "<\ufffd>", "a b", "\u2039é>"]
    lead = next(i for i in range(256) if tok.token_bytes(i) == b"\xc3")
    for ids in ([15496, 50257, 995], [64, 50258, 65], [lead, 50259, 50260, lead, 50258, lead, 50261, 50256]):
        stream = Detokenizer(tok)
        for n, token_id in enumerate(ids, 1):
            stream.add(token_id)
            assert stream.text == tok.decode(ids[:n]), ids[:n]


def test_a_stream_reads_each_token_once(tok: Tokenizer) -> None:
    """A run of bytes that never ends a character (continuation bytes) costs a token's bytes a token, not the
    whole run again at each one (which made 1,000 such tokens a quadratic 500,000 decodes)."""
    read = []

    class Counting:
        vocab_size = tok.vocab_size

        def token_bytes(self, token_id: int) -> bytes:
            read.append(token_id)
            return tok.token_bytes(token_id)

    continuation = next(i for i in range(256) if tok.token_bytes(i) == b"\x80")
    stream = Detokenizer(Counting())  # type: ignore[arg-type]
    for _ in range(1000):
        stream.add(continuation)
    assert read == [continuation] * 1000 and stream.text == "\ufffd" * 1000 and not stream.unfinished


# The pieces text is made of where a cut is easy to get wrong: runs of white space of every kind (Unicode's
# White_Space, and Python's own extras such as U+001C), contractions, digits, punctuation, letters that are
# not ASCII, and `<|endoftext|>`.
CUT_POOL = [
    *["the", " cat", "'s", "'t", "'re", " 42", "7", ",", ".", "!?", " (", "'", "-", "x", "é", "日本", "😀"],
    *["\n", "\n\n", " ", "  ", "\t", "\r\n", "\x0b", "\x1c", "\x85", "\u00a0", "\u1680", "\u2003", "\u2028"],
    *["\u202f", "\u3000", "\u180e", "\u200b", "\ufeff", "\x1f", "<", " <", EOT, "<|endoftext|"],
]


@settings(max_examples=400, deadline=None, database=None)
@given(text=st.lists(st.sampled_from(CUT_POOL), max_size=50).map("".join) | st.text(max_size=50))
@example(text="a b\nc  d\n\ne <|endoftext|> f\n<|endoftext|>\ng")
def test_a_cut_keeps_the_ids(tokenizer: Tokenizer, text: str) -> None:
    """`cut` is where a long text is tokenized in two (the harvest's pieces): both sides' ids are the whole's."""
    for special in (True, False):
        whole = tokenizer.encode(text, special=special)
        for lo in (0, len(text) // 2):
            for hi in range(lo, len(text) + 1):
                cut = tokenizer.cut(text, lo, hi)
                assert cut == 0 or lo < cut <= hi
                if cut:
                    assert tokenizer.encode(text[:cut], special) + tokenizer.encode(text[cut:], special) == whole


def test_where_cut_cuts(tok: Tokenizer) -> None:
    assert tok.cut("hello world", 0, 11) == 5  # before the space
    assert tok.cut("hello\nworld", 0, 11) == 5  # before the newline
    assert tok.cut("a b c d", 0, 4) == 3  # the last at or before hi
    assert tok.cut("a b c d", 3, 4) == 0  # ... and after lo
    text = "x" * 10_000 + " y" + "z" * 10_000
    assert tok.cut(text, 0, len(text)) == 10_000  # found far back
    # before the last character of a run of white space: paragraphs, indents, any kind of white space
    for text in ("a  b", "a\n\nb", "a \nb", "。\n\u3000\u3000b", "a\r\n\tb", "a\u00a0\u2028b"):
        assert tok.cut(text, 0, len(text)) == len(text) - 2, text
    assert tok.cut("a\tb", 0, 3) == tok.cut("a\u3000b", 0, 3) == tok.cut("a <|endoftext|>", 0, 15) == 1
    # none: at the ends, beside U+001C (white space to Python, not to Unicode), a longer run before <|
    for text in ("word", " a", "a ", "a\x1cb", "a  <|endoftext|>"):
        assert tok.cut(text, 0, len(text)) == 0, text
    # Python's \s (what `cut` takes for white space beside the cut) holds every White_Space character of
    # Unicode, which the tokenizers library's \s is, so no cut sits beside a character it takes for a space
    white_space = [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F]
    assert all(chr(c).isspace() for c in [*white_space, 0x205F, 0x3000])


def test_no_cut_for_a_tokenizer_that_splits_otherwise(tokenizer_dir: Path, tmp_path: Path) -> None:
    """A tokenizer.json whose pre-tokenizer adds a space in front (or has a normalizer, a special token with
    a space in it or that takes the spaces beside it, truncation) would give other ids on a cut's far side
    (with `rstrip`, "a<|endoftext|> b" is [64, 50256, 65] whole and [64, 50256, 275] cut before the space):
    such text is never cut."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert Tokenizer.from_dir(tokenizer_dir).cut("a b", 0, 3) == 1
    variants = [
        {**spec, "pre_tokenizer": {**spec["pre_tokenizer"], "add_prefix_space": True}},
        {**spec, "normalizer": {"type": "Lowercase"}},
        {**spec, "added_tokens": [*spec["added_tokens"], {**spec["added_tokens"][0], "id": 50257, "content": "a b"}]},
        {**spec, "added_tokens": [{**spec["added_tokens"][0], "rstrip": True}]},
        # "a\n\n[X]" is [64, 628, 50257] whole: [X] ends the text before it, as <|endoftext|> does
        {**spec, "added_tokens": [*spec["added_tokens"], {**spec["added_tokens"][0], "id": 50257, "content": "[X]"}]},
        {**spec, "added_tokens": [{**spec["added_tokens"][0], "lstrip": True}]},
        {**spec, "truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0}},
    ]
    for i, variant in enumerate(variants):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "tokenizer.json").write_text(json.dumps(variant), encoding="utf-8")
        assert Tokenizer.from_dir(tmp_path / str(i)).cut("a b", 0, 3) == 0, variant


def test_encode_takes_text(tok: Tokenizer) -> None:
    with pytest.raises(TypeError, match="a tokenizer encodes text \\(a str\\), not int"):
        tok.encode(123)  # type: ignore[arg-type]
