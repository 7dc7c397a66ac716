"""The tokenizer stored in a GGUF file, rebuilt on the `tokenizers` library.

Two vocabulary kinds, as llama.cpp reads them (``src/llama-vocab.cpp``):

* ``gpt2``: byte-level BPE with the file's merges, split first by the regex llama.cpp
  names with ``tokenizer.ggml.pre``;
* ``llama`` (SentencePiece): BPE over UTF-8 characters whose merges are every pair that
  forms a vocabulary token, ranked by that token's score (llama.cpp's bigram queue), with
  ``<0xNN>`` byte fallback and ``▁`` for spaces.

BOS is added when ``tokenizer.ggml.add_bos_token`` says so (default: SPM yes, BPE no),
control tokens in the text are parsed as specials, and the chat template, when present,
is rendered with jinja2.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .errors import ModelConfigError, RequestError
from .gguf_file import GGUFFile

# llama.cpp's pre-tokenizer regexes (llm_tokenizer_bpe), by `tokenizer.ggml.pre`.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]
PRE_TOKENIZERS = {
    "default": _DEFAULT,
    "gpt-2": [_GPT2],
    "llama3": [_LLAMA3],
    "llama-v3": [_LLAMA3],
    "llama-bpe": [_LLAMA3],
    "qwen2": [_QWEN2],
}

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def _bpe_pre_tokenizer(pre: str, path):
    if pre not in PRE_TOKENIZERS:
        raise ModelConfigError(
            path, f"pre-tokenizer '{pre}' (tokenizer.ggml.pre) is not supported (supported: {', '.join(PRE_TOKENIZERS)})"
        )
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
    return pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split (a, b) of a vocabulary token into two vocabulary tokens, best score first."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (TOKEN_NORMAL, TOKEN_USER, TOKEN_UNUSED)}
    ranked = []
    for t, i in vocab.items():
        for cut in range(1, len(t)):
            a, b = t[:cut], t[cut:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], i, cut, (a, b)))
    ranked.sort()
    return [pair for *_, pair in ranked]


class Tokenizer:
    """``encode(text) -> ids`` and ``decode(ids) -> text`` as llama.cpp does for this file."""

    def __init__(self, backend: HFTokenizer, *, bos_id, eos_ids, add_bos: bool, chat_template, kind: str, tokens,
                 path="tokenizer"):
        self.path = str(path)  # the file it came from, for errors
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = set(eos_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.kind = kind
        self.tokens = tokens

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.tokens[self.bos_id]

    @property
    def eos_token(self) -> str | None:
        return self.tokens[min(self.eos_ids)] if self.eos_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:  # a str from undecodable bytes (argv, a POSIX locale's stdin) holds lone surrogates
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"the text is not valid UTF-8: an undecodable byte at character {e.start}") from None
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render the GGUF's chat template (jinja2, sandboxed, HF's whitespace settings).

        A template that does not parse is the file's problem (:class:`ModelConfigError`); one that
        refuses the messages, as Gemma's refuse a system message, is the request's
        (:class:`~muse_mlx.errors.RequestError`, with the template's own words)."""
        if not self.chat_template:
            raise ModelConfigError(self.path, "this model has no chat template (tokenizer.chat_template)")
        from jinja2.exceptions import TemplateError, TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Refused(TemplateError):
            pass

        def raise_exception(message):
            raise Refused(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        env.globals["raise_exception"] = raise_exception
        try:
            template = env.from_string(self.chat_template)
        except TemplateSyntaxError as e:
            raise ModelConfigError(self.path, f"the chat template (tokenizer.chat_template) does not parse: {e}") from None
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except Refused as e:
            raise RequestError(f"the chat template of {self.path} refuses these messages: {e} "
                               "(the CLI's --ignore-chat-template sends the prompt as raw text)") from None
        except Exception as e:  # an error inside the template's own logic
            raise ModelConfigError(self.path, f"the chat template (tokenizer.chat_template) failed: "
                                              f"{type(e).__name__}: {e}") from None

    def detokenizer(self) -> "StreamingDetokenizer":
        return StreamingDetokenizer(self)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Tokenizer":
        try:
            return cls._from_gguf(f)
        except ModelConfigError:
            raise
        except Exception as e:  # `tokenizers` reports an inconsistent vocabulary as a bare Exception
            raise ModelConfigError(f.path, f"the tokenizer stored in the file cannot be built: {e}") from None

    @classmethod
    def _from_gguf(cls, f: GGUFFile) -> "Tokenizer":
        if not f.has("tokenizer.ggml.model"):
            raise ModelConfigError(f.path, "the file has no tokenizer (metadata key 'tokenizer.ggml.model' is missing)")
        kind = f.get_str("tokenizer.ggml.model")
        tokens = f.get_array("tokenizer.ggml.tokens")
        n = len(tokens)
        types = f.get_array("tokenizer.ggml.token_type", [TOKEN_NORMAL] * n)
        if len(types) != n:
            raise ModelConfigError(f.path, f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")

        def special_id(key):
            if not f.has(key):
                return None
            i = f.get_int(key)
            if not 0 <= i < n:
                raise ModelConfigError(f.path, f"metadata key '{key}' = {i} is outside the vocabulary (0..{n - 1})")
            return i

        bos, eos, eot = (special_id(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot"))
        unk = special_id("tokenizer.ggml.unknown_token_id")
        if kind == "gpt2":
            merges = f.get_array("tokenizer.ggml.merges", [])
            vocab = {t: i for i, t in enumerate(tokens)}
            pairs = []
            for m in merges:
                a, sep, b = m.partition(" ")
                if not sep:
                    raise ModelConfigError(f.path, f"tokenizer merge {m!r} is not of the form 'a b'")
                pairs.append((a, b))
            backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
            backend.pre_tokenizer = _bpe_pre_tokenizer(f.get_str("tokenizer.ggml.pre", "default"), f.path)
            backend.decoder = decoders.ByteLevel()
            add_bos = f.get_bool("tokenizer.ggml.add_bos_token", False)
        elif kind == "llama":
            scores = f.get_array("tokenizer.ggml.scores", [0.0] * n)
            if len(scores) != n:
                raise ModelConfigError(f.path, f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
            vocab = {t: i for i, t in enumerate(tokens)}
            unk_token = tokens[unk] if unk is not None else None
            backend = HFTokenizer(
                models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, types), unk_token=unk_token,
                           byte_fallback=True, fuse_unk=True)
            )
            prefix = f.get_bool("tokenizer.ggml.add_space_prefix", True)
            norms = [normalizers.Prepend("▁")] if prefix else []
            backend.normalizer = normalizers.Sequence(norms + [normalizers.Replace(" ", "▁")])
            steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
            add_bos = f.get_bool("tokenizer.ggml.add_bos_token", True)
        else:
            raise ModelConfigError(f.path, f"tokenizer model '{kind}' is not supported (supported: gpt2, llama)")
        specials = [
            AddedToken(tokens[i], special=types[i] == TOKEN_CONTROL, normalized=False)
            for i in range(n)
            if types[i] in (TOKEN_CONTROL, TOKEN_USER)
        ]
        backend.add_special_tokens([t for t in specials if t.special])
        backend.add_tokens([t for t in specials if not t.special])
        eos_ids = [i for i in (eos, eot) if i is not None]
        template = f.get_str("tokenizer.chat_template", None)
        return cls(backend, bos_id=bos, eos_ids=eos_ids, add_bos=add_bos, chat_template=template,
                   kind=kind, tokens=tokens, path=f.path)


class StreamingDetokenizer:
    """Text as tokens arrive, emitting only complete characters, in constant time a token.

    Each step decodes two short windows that start at the same token: the tokens already emitted
    since the last emission (``[prefix:read]``) and those plus the new ones (``[prefix:]``), and
    hands out what the second adds. Both windows start at a token whose predecessors decoded to
    whole characters, and a decoder's treatment of a window's first token (SentencePiece's strip
    of one leading space) is the same in both, so the pieces add up to the full decode. (Re-decoding
    everything since the last newline, as before, cost time linear in the line's length, 0.2 ms a
    token at 2,000 tokens, and dropped a SentencePiece token's leading space after each newline.)

    Two limits, shared with the old form: a window only moves when text comes out, so a run of
    tokens that print nothing (control tokens, bytes of no valid character) costs time in its
    length; and where SentencePiece's byte tokens spell invalid UTF-8 after a valid start, the full
    decode replaces the whole run with U+FFFD per byte while the stream has already handed out the
    valid start.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.reset()

    def reset(self):
        self.tokens: list[int] = []
        self.text = ""  # everything handed out so far
        self._prefix = 0  # the window's first token
        self._read = 0  # tokens before this one have been handed out

    def add_token(self, token: int) -> str:
        """Append a token and return the newly finished text (possibly empty)."""
        self.tokens.append(token)
        return self._take(complete_only=True)

    def finalize(self) -> str:
        """The rest, incomplete characters included (as the full decode would give them). Tokens
        added after it continue the same text (``reset`` starts another)."""
        return self._take(complete_only=False)

    def _take(self, complete_only: bool) -> str:
        """What the window ``[prefix:]`` adds to ``[prefix:read]``, handed out as an emission (the
        window then starts at the first token not yet handed out); with ``complete_only``, nothing
        while the text ends in an incomplete UTF-8 sequence."""
        done = self.tokenizer.decode(self.tokens[self._prefix : self._read])
        now = self.tokenizer.decode(self.tokens[self._prefix :])
        if complete_only and now.endswith("\ufffd"):  # wait for the sequence's next byte
            return ""
        new = now[len(done) :]
        if new:  # (nothing new yet: the window stays where it is)
            self._prefix, self._read = self._read, len(self.tokens)
            self.text += new
        return new
