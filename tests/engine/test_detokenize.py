"""Incremental detokenisation: the pieces join to the whole decode, at UTF-8 and byte-fallback
boundaries, and each update decodes a window of the new tokens, not the whole output."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from specdecode_worker.serving.detokenize import IncrementalText  # noqa: E402

TEXT = ("Déjà vu: naïve café, 東京タワー and 🚀🧪 in one line.\n  Indented  spaces,  tabs\tand "
        "ümlauts; then emoji pairs 👩‍👩‍👧 and a tail of ascii words.")


class Counting:
    """A tokenizer whose decode counts the tokens it is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _byte_fallback_tokenizer():
    """A SentencePiece-style BPE with byte fallback, as Llama 2 and Mistral ship: characters outside
    its small vocabulary become <0xNN> byte tokens, decoded back to UTF-8 only as a whole."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["▁", "a", "e", "h", "i", "n", "o", "s", "t", "▁t", "th", "▁th", "▁a", "in", "ne", "on"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("t", "h"), ("▁t", "h"), ("▁", "a"), ("i", "n"), ("n", "e"), ("o", "n")]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token=None))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def _tokenizers():
    from devtools.smollm2 import missing_requirements, smollm2_dir

    yield "byte-fallback", _byte_fallback_tokenizer()
    if missing_requirements() is None:
        yield "smollm2 byte-level BPE", transformers.AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.mark.parametrize("chunks", ["one token", "random chunks"])
def test_pieces_join_to_the_whole_decode_and_each_update_decodes_a_window(chunks):
    for name, tokenizer in _tokenizers():
        ids = tokenizer.encode(TEXT, add_special_tokens=False)
        assert len(ids) > 40, name
        want = tokenizer.decode(ids, skip_special_tokens=True)
        assert any(ord(ch) > 0x7FF for ch in want), name  # multi-byte characters split across tokens
        counting = Counting(tokenizer)
        text, pieces, rng, at = IncrementalText(counting), [], random.Random(0), 0
        while at < len(ids):
            n = 1 if chunks == "one token" else rng.randint(1, 4)
            piece = text.push(ids[at : at + n])
            assert "\ufffd" not in piece, (name, piece)  # no half of a character is ever sent
            pieces.append(piece)
            at += n
        assert "".join(pieces) == want, name
        # A window is the last piece's tokens and the new ones (longer only while a character is
        # incomplete): far below decoding the whole output each time (about n^2 / 2 tokens).
        assert counting.decoded <= 12 * len(ids), (name, counting.decoded, len(ids))


def test_no_tokenizer_gives_no_text():
    assert IncrementalText(None).push([1, 2, 3]) == ""
