"""Tokenizers built locally, never downloaded: what a pipeline with random weights (and the tests) encode prompts
with. Each is the transformers class the real pipeline declares (T5TokenizerFast, CLIPTokenizer, Qwen2Tokenizer,
LlamaTokenizerFast) with the real tokenizer's normalizer and pre-tokenizer (T5's metaspace Unigram; CLIP's, Qwen2's
and Llama-3's regexes with byte-level BPE) and a small vocabulary: byte-level BPE merges learned here,
deterministically, on the words of the pipelines' prompt templates and of a short word list, so those words are
single tokens and any other text still encodes (in smaller pieces). Where a pipeline crops its prompt template by
a fixed token count (QwenImagePipeline drops 34 tokens, HunyuanVideoPipeline's default template 95) the counts hold
for these tokenizers as for the real ones (the pipeline builders check them).

Token ids stay below the text encoder's vocabulary, so a random-weight encoder of the real size reads them; the
prompt's meaning is lost, its length (what the planner and the timings depend on) is not.
"""

from __future__ import annotations

import re

PROMPTS = {  # (prompt, negative prompt or None): every word is in the vocabularies below
    "wan": ("a cat walks on the grass", "blurry, low quality"),
    "flux": ("a red fox in the snow", None),
    "qwen": ("a cup of coffee on a wooden table", "blurry, low quality"),
    "hunyuan": ("a dog runs on the beach", None),
}
EXTRA_WORDS = "a an the of on in at with and cat dog fox walks runs sits red blue green snow grass beach cup " \
              "coffee wooden table blurry low quality bad ugly photo video image"




def _texts(template: str | None = None) -> list[str]:
    out = [EXTRA_WORDS] + [p for pair in PROMPTS.values() for p in pair if p]
    return out + ([template.replace("{}", " ")] if template else [])


def _pieces(backend, texts: list[str], specials: list[str]) -> list[str]:
    """The pre-tokens of `texts` under `backend`'s normalizer and pre-tokenizer (special tokens split out first,
    as added tokens are), in first-seen order."""
    out: list[str] = []
    split = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
    for text in texts:
        for part in (split.split(text) if split else [text]):
            if not part or part in specials:
                continue
            if backend.normalizer is not None:
                part = backend.normalizer.normalize_str(part)
            out += [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(part)]
    return list(dict.fromkeys(out))


def _train_bpe(words: list[str], suffix: str = "") -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE learned on `words` (pre-tokens) until each is one token: (vocab, merges).

    Plain Python, ties broken by the pair's text, so the result is the same in every process. The vocabulary
    starts with the 256 byte-level symbols (and, with `suffix`, CLIP's end-of-word variants), so any text encodes
    without unknown tokens; words outside `words` fall apart into smaller pieces.
    """
    from collections import Counter

    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = alphabet + ([a + suffix for a in alphabet] if suffix else [])
    segs = [list(w[:-1]) + [w[-1] + suffix] for w in words]
    merges: list[tuple[str, str]] = []
    while True:
        counts = Counter(pair for seg in segs for pair in zip(seg, seg[1:]))
        if not counts:
            break
        a, b = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append((a, b))
        vocab.append(a + b)
        for seg in segs:
            i = 0
            while i < len(seg) - 1:
                if seg[i] == a and seg[i + 1] == b:
                    seg[i:i + 2] = [a + b]
                i += 1
    return {t: i for i, t in enumerate(dict.fromkeys(vocab))}, merges


def _check_single_tokens(tokenizer, words: list[str]) -> None:
    backend = tokenizer.backend_tokenizer
    bad = [w for w in words if len(backend.model.tokenize(w)) != 1]
    assert not bad, f"{type(tokenizer).__name__}: words not single tokens: {bad[:5]}"


def _register_specials(tokenizer, specials: list[str]) -> None:
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)


QWEN_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
T5_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"()-_/"


def t5_tokenizer(max_length: int = 512):
    """T5TokenizerFast (T5's Unigram + metaspace): pad 0, eos 1, unk 2, the prompt words, single characters."""
    from transformers import T5TokenizerFast

    words = list(dict.fromkeys(w.lower() for t in _texts() for w in re.findall(r"[A-Za-z]+|[^\sA-Za-z]", t)))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -4.0) for w in words] + [(w, -6.0) for w in words if len(w) > 1]
    vocab += [(c, -12.0) for c in T5_CHARS]
    vocab = list({t: (t, s) for t, s in reversed(vocab)}.values())[::-1]  # unique pieces, first score wins
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=max_length, padding_side="right")


def clip_tokenizer():
    """CLIPTokenizer (CLIP's own normalizer, regex and `</w>` BPE): bos/eos are the last two ids, as in CLIP."""
    from transformers import CLIPTokenizer

    bos, eos = "<|startoftext|>", "<|endoftext|>"
    words = _pieces(CLIPTokenizer().backend_tokenizer, _texts(), [bos, eos])
    vocab, merges = _train_bpe(words, suffix="</w>")
    vocab.update({bos: len(vocab), eos: len(vocab) + 1})
    tok = CLIPTokenizer(vocab=vocab, merges=merges, bos_token=bos, eos_token=eos, pad_token=eos, unk_token=eos,
                        model_max_length=77, padding_side="right")
    _check_single_tokens(tok, words)
    return tok


# QwenImagePipeline's prompt_template_encode (diffusers 0.42.1); _qwen checks the pipeline's own against it
QWEN_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                 "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
                 "{}<|im_end|>\n<|im_start|>assistant\n")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


def qwen_tokenizer(template: str):
    """Qwen2Tokenizer (Qwen2's own regex + byte-level BPE) learned on `template` and the prompts; the chat and
    vision special tokens follow the BPE vocabulary."""
    from transformers import Qwen2Tokenizer

    words = _pieces(Qwen2Tokenizer().backend_tokenizer, _texts(template), QWEN_SPECIALS)
    vocab, merges = _train_bpe(words)
    vocab.update({t: len(vocab) + i for i, t in enumerate(QWEN_SPECIALS)})
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|endoftext|>",
                         pad_token="<|endoftext|>", model_max_length=32768, padding_side="right")
    _register_specials(tok, QWEN_SPECIALS)
    _check_single_tokens(tok, words)
    return tok


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def llama_tokenizer(template: str):
    """LlamaTokenizerFast holding a Llama-3 style tokenizer (Llama-3's regex + byte-level BPE, merges ignored for
    whole-word hits, `<|begin_of_text|>` prepended) learned on `template` and the prompts."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import LlamaTokenizerFast

    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    probe = Tokenizer(BPE())
    probe.pre_tokenizer = pre
    words = _pieces(probe, _texts(template), LLAMA3_SPECIALS)
    vocab, merges = _train_bpe(words)
    vocab.update({t: len(vocab) + i for i, t in enumerate(LLAMA3_SPECIALS)})
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=True))
    backend.pre_tokenizer, backend.decoder = pre, decoders.ByteLevel()
    bos = "<|begin_of_text|>"
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, vocab[bos])])
    backend.add_special_tokens(LLAMA3_SPECIALS)
    tok = LlamaTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token="<|eot_id|>", unk_token=None,
                             pad_token="<|end_of_text|>", model_max_length=4096, padding_side="right")
    _check_single_tokens(tok, words)
    return tok


def build_tokenizer(kind: str, max_length: int = 512, template: str | None = None):
    """A local tokenizer of `kind` (t5, clip, qwen2, llama3); `template`: the pipeline's prompt template."""
    if kind == "t5":
        return t5_tokenizer(max(max_length, 512))  # the pipeline pads and truncates to its own length
    if kind == "clip":
        return clip_tokenizer()
    if kind == "qwen2":
        return qwen_tokenizer(template or QWEN_TEMPLATE)
    if kind == "llama3":
        if template is None:
            from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

            template = DEFAULT_PROMPT_TEMPLATE["template"]
        return llama_tokenizer(template)
    raise ValueError(f"unknown tokenizer kind {kind!r}; known: t5, clip, qwen2, llama3")
