"""The GGUF tokenizer: byte-level BPE and SentencePiece vocabularies, BOS, specials, templates, streaming."""

from __future__ import annotations

import re

import numpy as np
import pytest

from muse_mlx.errors import ModelConfigError, RequestError
from muse_mlx.gguf_file import GGUFFile
from muse_mlx.tokenizer import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, Tokenizer
from muse_mlx.vocab import SAMPLE_TEXT, Vocab, byte_alphabet, tiny_vocab, train_byte_bpe
from muse_mlx.writer import Geometry, write_tiny

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Unicode: café, naïve, 日本語, emoji 🙂 and 1234567 digits",
    "it's we're they'll I'd",
]


def spm_vocab() -> Vocab:
    """A small SentencePiece-style vocabulary: specials, 256 byte pieces, then scored pieces."""
    pieces = ["▁", "▁t", "he", "▁the", "▁a", "in", "er", "▁w", "or", "ld", "▁wor", "▁world", "ll", "o", "llo",
              "▁H", "▁He", "▁Hello"]
    pieces += sorted(set(SAMPLE_TEXT) - {" "})
    seen, uniq = set(), []
    for p in pieces:
        if p not in seen:
            seen.add(p)
            uniq.append(p)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + uniq
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256 + [TOKEN_NORMAL] * len(uniq)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(uniq))]
    return Vocab(tokens=tokens, merges=[], types=types, bos_id=1, eos_id=2, chat_template="",
                 model="llama", scores=scores, unk_id=0)


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    vocab = train_byte_bpe([SAMPLE_TEXT] * 4 + TEXTS, 400)
    return write_tiny(tmp_path_factory.mktemp("tok") / "bpe.gguf", "qwen3", "f32", vocab=vocab)


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tok") / "spm.gguf", "llama", "f32", vocab=spm_vocab(),
                      geometry=Geometry(n_layer=1))


@pytest.mark.parametrize("text", TEXTS)
def test_byte_bpe_round_trips(bpe_path, text):
    tok = Tokenizer.from_gguf(GGUFFile(bpe_path))
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id  # the file says add_bos_token = true
    assert tok.decode(ids) == text


def test_byte_bpe_uses_merges(bpe_path):
    tok = Tokenizer.from_gguf(GGUFFile(bpe_path))
    ids = tok.encode("the quick brown fox", add_special_tokens=False)
    assert len(ids) < len("the quick brown fox") // 2
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_byte_bpe_alphabet_is_gpt2s():
    alpha = byte_alphabet()
    assert len(set(alpha)) == 256 and alpha[ord("A")] == "A" and alpha[ord(" ")] == "Ġ" and alpha[10] == "Ċ"


def test_control_tokens_in_text_are_specials(bpe_path):
    tok = Tokenizer.from_gguf(GGUFFile(bpe_path))
    ids = tok.encode("<|user|>hi<|eot|>", add_special_tokens=False)
    assert ids[0] == tok.tokens.index("<|user|>") and ids[-1] == tok.tokens.index("<|eot|>")
    assert tok.decode(ids) == "hi"  # control tokens are not printed
    assert tok.decode(ids, skip_special_tokens=False) == "<|user|>hi<|eot|>"


def test_chat_template_errors_name_the_file_and_the_problem(bpe_path):
    """A template that refuses the messages (as Gemma's refuse a system message) is the request's
    problem, in the template's words; one that does not parse or fails inside is the file's."""
    tok = Tokenizer.from_gguf(GGUFFile(bpe_path))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tok.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    with pytest.raises(RequestError, match=f"chat template of {re.escape(str(bpe_path))} refuses these messages: "
                                           "System role not supported"):
        tok.apply_chat_template(msgs)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }"
    with pytest.raises(ModelConfigError, match="does not parse"):
        tok.apply_chat_template(msgs)
    tok.chat_template = "{{ messages[0]['content'] + 1 }}"
    with pytest.raises(ModelConfigError, match="failed: TypeError"):
        tok.apply_chat_template(msgs)
    tok.chat_template = ""
    with pytest.raises(ModelConfigError, match=f"{re.escape(str(bpe_path))}: this model has no chat template"):
        tok.apply_chat_template(msgs)


def test_eos_and_bos_come_from_the_file(bpe_path):
    tok = Tokenizer.from_gguf(GGUFFile(bpe_path))
    assert tok.tokens[tok.bos_id] == "<|bos|>" and tok.eos_ids == {tok.tokens.index("<|eot|>")}


def test_chat_template_renders(bpe_path):
    tok = Tokenizer.from_gguf(GGUFFile(bpe_path))
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|bos|><|system|>Be brief.<|eot|><|user|>Hi<|eot|><|assistant|>"


STREAMED = TEXTS + ["a\n b", "line one\n  indented two\nthree\n \n"]  # spaces after newlines (SentencePiece strips a window's first)


@pytest.mark.parametrize("kind", ["bpe", "spm"])
@pytest.mark.parametrize("text", STREAMED)
def test_streaming_detokenizer_equals_full_decode(bpe_path, spm_path, kind, text):
    tok = Tokenizer.from_gguf(GGUFFile(bpe_path if kind == "bpe" else spm_path))
    ids = tok.encode(text, add_special_tokens=False)
    d = tok.detokenizer()
    pieces = [d.add_token(i) for i in ids] + [d.finalize()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # never a half character
    assert d.text == text


@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_streaming_detokenizer_on_random_ids(bpe_path, spm_path, kind):
    """Any ids, not only encodings of text: control tokens (printed as nothing), single bytes of
    multi-byte characters, space-only pieces; a finalize in the middle continues the same text.
    (SentencePiece's byte tokens are left out: an invalid UTF-8 run after a valid start is where the
    stream and the full decode differ, StreamingDetokenizer's docstring.)"""
    tok = Tokenizer.from_gguf(GGUFFile(bpe_path if kind == "bpe" else spm_path))
    rng = np.random.default_rng(5)
    ids = [i for i in range(tok.vocab_size) if kind == "bpe" or not tok.tokens[i].startswith("<0x")]
    for _ in range(300):
        seq = [int(i) for i in rng.choice(ids, size=int(rng.integers(1, 40)))]
        d = tok.detokenizer()
        cut = int(rng.integers(0, len(seq) + 1))
        pieces = [d.add_token(i) for i in seq[:cut]]
        if not tok.decode(seq[:cut]).endswith("\ufffd"):  # finalize where the text is whole so far
            pieces.append(d.finalize())
        pieces += [d.add_token(i) for i in seq[cut:]] + [d.finalize()]
        assert "".join(pieces) == tok.decode(seq), seq


@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_streaming_detokenizer_decodes_a_few_tokens_a_step(bpe_path, spm_path, kind, monkeypatch):
    """Constant work a token: every decode it makes covers a handful of tokens, however long the
    line (re-decoding since the last newline made a 2,000-token line cost 0.2 ms a token)."""
    tok = Tokenizer.from_gguf(GGUFFile(bpe_path if kind == "bpe" else spm_path))
    text = " ".join(TEXTS).replace("\n", " ") * 20  # one long line
    ids = tok.encode(text, add_special_tokens=False)
    sizes, decode = [], tok.decode
    monkeypatch.setattr(tok, "decode", lambda window, **kw: sizes.append(len(window)) or decode(window, **kw))
    d = tok.detokenizer()
    pieces = [d.add_token(i) for i in ids] + [d.finalize()]
    assert "".join(pieces) == text and len(ids) > 500
    assert max(sizes) <= 8, max(sizes)  # a multi-byte character's tokens and the one before them


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_round_trips_with_byte_fallback(spm_path, text):
    tok = Tokenizer.from_gguf(GGUFFile(spm_path))
    ids = tok.encode(text)
    assert ids[0] == 1  # SPM default: BOS
    assert tok.decode(ids) == text


def test_sentencepiece_prefers_high_score_pieces(spm_path):
    tok = Tokenizer.from_gguf(GGUFFile(spm_path))
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert [tok.tokens[i] for i in ids] == ["▁Hello", "▁world"]


def test_writer_vocabulary_is_deterministic():
    assert tiny_vocab().tokens == tiny_vocab().tokens and tiny_vocab().merges == tiny_vocab().merges


@pytest.mark.llama_cpp
@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_token_ids_match_llama_cpp(bpe_path, spm_path, which):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = bpe_path if which == "bpe" else spm_path
    tok = Tokenizer.from_gguf(GGUFFile(path))
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in TEXTS:
        theirs = llm.tokenize(text.encode(), add_bos=True, special=True)
        assert tok.encode(text) == theirs, text
