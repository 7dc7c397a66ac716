"""Byte-level BPE vocabularies for the checkpoints the project writes itself.

A vocabulary here is what a GGUF file stores under ``tokenizer.ggml.*`` for the ``gpt2``
model: tokens spelled in GPT-2's byte-to-unicode alphabet, their types, the merges, the
special ids and a chat template. Training uses the `tokenizers` library's BPE trainer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from .tokenizer import _GPT2, TOKEN_CONTROL, TOKEN_NORMAL

SPECIALS = ("<|bos|>", "<|eot|>", "<|system|>", "<|user|>", "<|assistant|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|eot|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the 256 printable stand-ins for bytes, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@dataclass
class Vocab:
    """What a GGUF stores under ``tokenizer.ggml.*``: ``model`` "gpt2" (merges) or "llama" (scores)."""

    tokens: list[str]
    merges: list[str]
    types: list[int]
    bos_id: int
    eos_id: int
    chat_template: str = CHAT_TEMPLATE
    pre: str = "gpt-2"
    add_bos: bool = True
    model: str = "gpt2"
    scores: list[float] | None = None
    unk_id: int | None = None

    def __len__(self) -> int:
        return len(self.tokens)


def train_byte_bpe(texts, vocab_size: int) -> Vocab:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens (bytes + merges + specials)."""
    n_merges = vocab_size - 256 - len(SPECIALS)
    if n_merges < 0:
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIALS)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_GPT2), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=256 + n_merges, initial_alphabet=byte_alphabet(), show_progress=False, min_frequency=2
    )
    tok.train_from_iterator(texts, trainer=trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in merges][:n_merges]
    return _assemble(merges)


def _assemble(merges: list[str]) -> Vocab:
    """Bytes, then each merge's result in merge order, then the specials."""
    tokens = byte_alphabet()
    seen = set(tokens)
    for m in merges:
        a, b = m.split(" ")
        if a + b not in seen:
            tokens.append(a + b)
            seen.add(a + b)
    n_normal = len(tokens)
    tokens += list(SPECIALS)
    types = [TOKEN_NORMAL] * n_normal + [TOKEN_CONTROL] * len(SPECIALS)
    return Vocab(tokens=tokens, merges=merges, types=types, bos_id=n_normal, eos_id=n_normal + 1)


# A fixed sample so the tiny checkpoints' vocabulary has real merges (llama.cpp requires some).
SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello world! This is a tiny model of the Muse "
    "Glimmer family, written by muse_mlx itself. It has random weights, so the text it makes is "
    "noise; the point is that every part of the engine runs. The norms, the attention, the gate, "
    "the feed-forward block and the head are all here, and they are the same as in the large model."
)


def tiny_vocab(size: int = 320) -> Vocab:
    """The tiny checkpoints' vocabulary: bytes, merges learned from SAMPLE_TEXT, specials."""
    return train_byte_bpe([SAMPLE_TEXT] * 4, size)
