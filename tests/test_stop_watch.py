"""The engine's stop-string watch against decoding the whole output at every token, on three
kinds of tokenizer trained here: byte-level BPE (Qwen, Llama 3), SentencePiece-style with byte
fallback (Llama 2, Mistral) and WordPiece with its space cleanup (BERT)."""

from __future__ import annotations

import functools
import random
from types import SimpleNamespace

import pytest

from slime.engines.torch_engine.stop_watch import StopWatch
from slime.engines.torch_engine.tokens import SharedTokenizer

CORPUS = [
    "héllo wörld, 你好 世界! emoji 🙂🙃 the end.",
    "The quick brown fox jumps over the lazy dog.\n\nAnswer: 42 ###",
    "don't stop - it's 3.14 ; (x + y) * z = 0 ?",
] * 30
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]


def _byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet)
    )
    return tok, {}


def _byte_fallback():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS + byte_tokens)
    )
    return tok, {}


def _word_piece():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)  # the cleanup left to transformers
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=SPECIALS))
    return tok, {"clean_up_tokenization_spaces": True}


def _shared(kind, path) -> SharedTokenizer:
    """The engine's tokenizer over a tokenizer of `kind` (one of the three above), saved at `path`."""
    from transformers import PreTrainedTokenizerFast

    backend, options = kind()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", **options)
    tokenizer.save_pretrained(path)
    return SharedTokenizer(str(path), SimpleNamespace(config=SimpleNamespace(eos_token_id=None)))


@pytest.fixture(
    params=[_byte_level, _byte_fallback, _word_piece], ids=["byte-level", "byte-fallback", "wordpiece"]
)
def shared(request, tmp_path):
    return _shared(request.param, tmp_path)


def _first_stop(push, decode, ids, stops):
    """The number of tokens after which the output first holds a stop string (0: never)."""
    for k in range(1, len(ids) + 1):
        if push(ids[k - 1]) and any(s in decode(ids[:k]) for s in stops):
            return k
    return 0


def test_the_watch_stops_at_the_token_that_decoding_the_whole_output_stops_at(shared):
    """Random outputs (byte tokens that form no character, skipped special tokens, words that
    the cleanup joins) and stop strings cut from their text: the watch, whose every token decodes
    a few ids, ends each output at the same token as decoding the whole output after every token
    does, special tokens skipped or not."""
    rng = random.Random(0)
    vocab = len(shared.tokenizer)
    checked = 0
    for trial in range(240):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(20, 60))]
        skip = trial % 2 == 0
        text = shared.decode(ids, skip)
        start = rng.randrange(len(text))
        stop = text[start : start + rng.randrange(1, 7)]
        if not stop.strip() or "\ufffd" in stop:
            continue
        stops = (stop, "@@never@@")
        watch = shared.watch_stops(stops, skip)
        decode = functools.partial(shared.decode, skip_special_tokens=skip)
        expected = _first_stop(lambda _: True, decode, ids, stops)
        assert expected > 0
        assert _first_stop(watch.push, decode, ids, stops) == expected, (ids, stops)
        checked += 1
    assert checked > 90


def test_a_character_completed_after_invalid_bytes_is_seen(tmp_path):
    """Byte tokens: two stray bytes, then the three of one character, then "h". Still incomplete
    after four tokens, the text shows as it decodes (three replacement characters); the next token
    turns the last of them into the character, which the watch then shows in its place."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    shared = _shared(_byte_level, tmp_path)
    byte_token = bytes_to_unicode()
    ids = [shared.tokenizer.convert_tokens_to_ids(byte_token[b]) for b in b"\x80\x80\xe4\xbd\xa0h"]
    assert shared.decode(ids) == "\ufffd\ufffd你h"
    for stop, at in (("你", 5), ("你h", 6), ("\ufffd你", 5)):
        watch = shared.watch_stops((stop,), True)
        assert _first_stop(watch.push, shared.decode, ids, (stop,)) == at, stop


def test_a_first_token_that_shows_nothing_alone_keeps_its_space(tmp_path):
    """SentencePiece-style: a first "▁" decodes to nothing alone (the leading space is stripped),
    but "▁" then "▁the" decode to " the": the stop " the" ends the second token."""
    shared = _shared(_byte_fallback, tmp_path)
    ids = shared.tokenizer.convert_tokens_to_ids(["▁", "▁the"])
    assert shared.decode(ids[:1]) == "" and shared.decode(ids) == " the"
    watch = shared.watch_stops((" the",), True)
    assert _first_stop(watch.push, shared.decode, ids, (" the",)) == 2


def test_the_cleanup_of_spaces_is_watched_for():
    """A tokenizer whose decode joins " ." into ".": the stop "end." is seen though the tokens'
    own texts hold "end ."."""
    decode = lambda ids: " ".join(["the", "end", "."][i] for i in ids)  # noqa: E731
    clean_up = lambda text: text.replace(" .", ".")  # noqa: E731
    plain, cleaned = StopWatch(decode, ["end."]), StopWatch(decode, ["end."], clean_up)
    assert [plain.push(t) for t in (0, 1, 2)] == [False, False, False]
    assert [cleaned.push(t) for t in (0, 1, 2)] == [False, False, True]


def test_bytes_that_never_form_a_character_show_after_four_tokens():
    """Text still incomplete after 4 tokens (more than any character takes) is shown as it
    decodes, so invalid bytes do not make the context, and each token's decode, grow."""
    seen = []

    def decode(ids):
        seen.append(len(ids))
        return "\ufffd" * len(ids)

    watch = StopWatch(decode, ["\ufffd" * 8])
    hits = [watch.push(0) for _ in range(100)]
    assert hits.index(True) == 7  # shown 4 at a time: 4, then 8
    assert max(seen) == 8  # 4 shown as context, 4 pending


def test_tokens_that_show_nothing_do_not_grow_each_tokens_decode():
    """Skipped special tokens (text "") are left out of the context: a thousand of them cost
    a thousand one-token decodes, and a stop string around them is still seen."""
    seen = []

    def decode(ids):
        seen.append(len(ids))
        return "".join("" if i == 0 else "ab"[i - 1] for i in ids)

    watch = StopWatch(decode, ["ab"])
    assert watch.push(1) is False
    assert not any(watch.push(0) for _ in range(1000))
    assert watch.push(2) is True
    assert max(seen) == 2
