"""IncrementalDetokenizer: UTF-8 safety, stop strings, special tokens, per-token cost."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ironlm.detokenizer import IncrementalDetokenizer
from ironlm.model.default import default_model_path

TEXTS = [
    "héllo wörld 日本語 🙂 naïve café",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé ☃ snowman — em dash … ellipsis 🚀🚀",
    "hello hello world, 日本 is Japan; 東京 is Tokyo",
    "emoji 🙂🙃🚀 and accents éèêë, Ελληνικά, русский",
]


@pytest.fixture(scope="module")
def bpe() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE, small enough that most non-ASCII characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["<|im_end|>"])


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    """Llama-style: Metaspace words, byte-fallback <0xNN> tokens, and a decoder that strips the leading space
    (so a token's text depends on what precedes it)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["hello world this is a test", "the quick brown fox jumps over the lazy dog"], trainer)
    spec = json.loads(tok.to_str())
    for b in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(spec["model"]["vocab"]))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return Tokenizer.from_str(json.dumps(spec))


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int] | None = None) -> list[str]:
    deltas, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        d = detok.add(ids[i:i + n])
        deltas.append(d.text)
        i += n
        if d.stopped:
            return deltas
    deltas.append(detok.finish().text)
    return deltas


def test_tokenizer_really_splits_characters(bpe: PreTrainedTokenizerFast) -> None:
    # Guard for the tests below: single tokens of these texts decode to broken UTF-8.
    ids = bpe.encode(TEXTS[0])
    assert any("\ufffd" in bpe.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_never_broken_and_concatenation_equals_decode(bpe: PreTrainedTokenizerFast, text: str) -> None:
    prompt = bpe.encode("prompt: 日本")
    ids = bpe.encode(text)
    rng = random.Random(len(text))
    for sizes in (None, [rng.randint(1, 4) for _ in ids]):
        detok = IncrementalDetokenizer(bpe, prompt)
        deltas = stream(detok, ids, sizes)
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == bpe.decode(ids) == text
        assert detok.output_text == text


def test_context_dependent_leading_space_and_byte_fallback(spm: Tokenizer) -> None:
    prompt = spm.encode("hello").ids
    ids = spm.encode("hello world wörld 日本 fox").ids[1:]  # drop the first word: output starts with "▁world"
    assert spm.decode(ids[:1]) == "world"  # alone, the decoder strips the space...
    deltas = stream(IncrementalDetokenizer(spm, prompt), ids)
    assert "".join(deltas) == " world wörld 日本 fox"  # ...in context it must be there
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(bpe: PreTrainedTokenizerFast) -> None:
    text = "hello hello world, 日本 is Japan"
    ids = bpe.encode(text)
    detok = IncrementalDetokenizer(bpe, [], stop=["日本 is"])
    deltas = stream(detok, ids)
    assert detok.stopped and detok.stop_str == "日本 is"
    assert detok.output_text == "hello hello world, "
    assert "".join(deltas) == detok.output_text
    assert not any("日" in d for d in deltas)


def test_include_stop_str_in_output(bpe: PreTrainedTokenizerFast) -> None:
    ids = bpe.encode("hello hello world, 日本 is Japan")
    detok = IncrementalDetokenizer(bpe, [], stop=["日本"], include_stop_str_in_output=True)
    deltas = stream(detok, ids)
    assert detok.output_text == "hello hello world, 日本" == "".join(deltas)


def test_partial_stop_match_is_held_back_then_released(bpe: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(bpe, [], stop=["worldwide"])
    ids = bpe.encode("hello world, bye")
    seen = ""
    for i in ids:
        seen += detok.add([i]).text
        full = bpe.decode(ids[: ids.index(i) + 1])
        # Whatever could still become "worldwide" is not out yet; everything else is.
        if full.endswith("world"):
            assert seen == full[: -len("world")]
    seen += detok.finish().text
    assert seen == "hello world, bye" and not detok.stopped


def test_earliest_stop_string_wins_and_text_after_stop_is_ignored(bpe: PreTrainedTokenizerFast) -> None:
    ids = bpe.encode("The quick brown fox jumps over the lazy dog.")
    detok = IncrementalDetokenizer(bpe, [], stop=["lazy", "brown", "fox"])
    text = "".join(stream(detok, ids, [len(ids)]))  # everything in one step: one decode, earliest match
    assert text == "The quick " and detok.stop_str == "brown"
    after = detok.add(bpe.encode(" more"))
    assert after.text == "" and after.stopped


def test_skip_special_tokens(bpe: PreTrainedTokenizerFast) -> None:
    ids = bpe.encode("hello") + [bpe.convert_tokens_to_ids("<|im_end|>")] + bpe.encode(" world")
    skipped = IncrementalDetokenizer(bpe, [], skip_special_tokens=True)
    kept = IncrementalDetokenizer(bpe, [], skip_special_tokens=False)
    assert "".join(stream(skipped, ids)) == "hello world" == bpe.decode(ids, skip_special_tokens=True)
    assert "".join(stream(kept, ids)) == "hello<|im_end|> world" == bpe.decode(ids)


def test_stop_string_can_match_special_token_text(bpe: PreTrainedTokenizerFast) -> None:
    ids = bpe.encode("hello") + [bpe.convert_tokens_to_ids("<|im_end|>")] + bpe.encode(" world")
    detok = IncrementalDetokenizer(bpe, [], skip_special_tokens=False, stop=["<|im_end|>"])
    stream(detok, ids)
    assert detok.output_text == "hello" and detok.stopped


def test_finish_flushes_an_incomplete_character_like_decode(bpe: PreTrainedTokenizerFast) -> None:
    ids = bpe.encode("ok 🚀")
    cut = ids[:-1]  # the last character's final byte never arrives
    assert bpe.decode(cut).endswith("\ufffd")
    detok = IncrementalDetokenizer(bpe, [])
    deltas = [detok.add([i]).text for i in cut]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.finish().text == bpe.decode(cut)


class CountingTokenizer:
    """Records how many ids each decode call sees (stands in for a slow tokenizer: no backend)."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner, self.decoded = inner, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: object) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_token_is_constant(bpe: PreTrainedTokenizerFast) -> None:
    ids = bpe.encode(" ".join(TEXTS)) * 40
    counting = CountingTokenizer(bpe)
    deltas = stream(IncrementalDetokenizer(counting, bpe.encode("a prompt"), stop=["never matches"]), ids)
    assert "".join(deltas) == bpe.decode(ids)
    # Re-decoding the whole output would be ~len(ids)^2 / 2 ids; a short window is a few per token.
    assert counting.decoded < 12 * len(ids)


# -- the real default model's tokenizer (the Makefile installs it; no skip) ------------------------------------


@pytest.fixture(scope="module")
def smollm2(request: pytest.FixtureRequest):
    gguf = default_model_path()  # no skip: a missing package fails with the install command, as everywhere
    # Converting the GGUF vocabulary takes seconds; keep the converted tokenizer in pytest's cache folder,
    # keyed by the file's size and mtime, so later runs load it in a fraction of a second.
    stat = gguf.stat()
    cached = request.config.cache.mkdir(f"smollm2-tokenizer-{stat.st_size}-{int(stat.st_mtime)}")
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(cached))
    return tok


def test_smollm2_chat_stream(smollm2) -> None:
    prompt = smollm2.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    answer = "Héllo! 日本語 is fun 🙂 — “quotes” … done"
    ids = smollm2.encode(answer) + [smollm2.convert_tokens_to_ids("<|im_end|>")]
    detok = IncrementalDetokenizer(smollm2, prompt, stop=["is fun"], include_stop_str_in_output=True)
    deltas = stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "Héllo! 日本語 is fun"
    plain = IncrementalDetokenizer(smollm2, prompt)
    assert "".join(stream(plain, ids)) == answer == smollm2.decode(ids, skip_special_tokens=True)
