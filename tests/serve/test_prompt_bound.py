"""max_token_bytes: the most input bytes one token can cover, and None wherever a tokenizer
step could drop or shrink text (then no prompt may be refused by its length in bytes)."""
from __future__ import annotations

from types import SimpleNamespace

from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import BPE, WordPiece
from transformers import AutoTokenizer

from fake_engine import ByteTokenizer
from raypaged.serve.prompt_bound import byte_level_alphabet, max_token_bytes


def bpe(vocab: list[str], **model) -> Tokenizer:
    return Tokenizer(BPE({piece: i for i, piece in enumerate(vocab)}, [], **model))


def bound(backend: Tokenizer) -> int | None:
    return max_token_bytes(SimpleNamespace(backend_tokenizer=backend))


def test_the_default_models_longest_token_is_a_newline_and_80_spaces(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    assert tokenizer.decode(tokenizer.encode("\n" + " " * 80)) == "\n" + " " * 80
    assert max_token_bytes(tokenizer) == 81


def test_byte_level_alphabet_maps_256_characters_to_the_bytes_they_spell():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert (alphabet["a"], alphabet["Ġ"], alphabet["Ċ"], alphabet["Ã"]) == (97, 32, 10, 0xC3)


def test_byte_level_pieces_count_the_bytes_they_spell_not_their_utf8():
    tok = bpe(["Ġhello", "Ã©Ã©Ã©"])  # " hello" (6 bytes) and "ééé" (6 bytes; 12 in UTF-8 here)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert bound(tok) == 6
    tok.add_tokens(["<|a special token|>"])  # matched as written: 19 bytes
    assert bound(tok) == 19


def test_other_vocabularies_count_utf8_which_can_only_overstate():
    tok = bpe(["▁hello", "<0x0A>"], byte_fallback=True, unk_token="<unk>")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    assert bound(tok) == 8  # "▁hello" stands for " hello", 6 bytes


def test_no_bound_where_a_step_can_drop_or_shrink_text():
    unk = bpe(["a"], unk_token="a")  # an unknown run may become one token
    assert bound(unk) is None
    wordpiece = Tokenizer(WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert bound(wordpiece) is None
    stripped = bpe(["a"])
    stripped.normalizer = normalizers.Strip()
    assert bound(stripped) is None
    shrinking = bpe(["a"])
    shrinking.normalizer = normalizers.Replace("  ", " ")
    assert bound(shrinking) is None
    split_away = bpe(["a"])
    split_away.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", "removed"), pre_tokenizers.ByteLevel()])
    assert bound(split_away) is None
    whitespace = bpe(["a"])
    whitespace.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert bound(whitespace) is None
    absorbing = bpe(["a"])
    absorbing.add_tokens([AddedToken("<mask>", lstrip=True)])
    assert bound(absorbing) is None
    assert max_token_bytes(ByteTokenizer()) is None  # not a Hugging Face fast tokenizer


def test_steps_that_keep_every_byte_keep_the_bound():
    kept = bpe(["ab"])
    kept.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", "isolated"), pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert bound(kept) == 2
