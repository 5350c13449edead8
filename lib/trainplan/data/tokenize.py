"""The tokenizer: a Hugging Face `tokenizers` `tokenizer.json`, given or trained here.

A team brings the tokenizer of its model (`load`), or trains a byte-level BPE on its
corpus (`train`: byte-level pre-tokenisation, so that every text encodes with no unknown
token, and `EOS` as the special token between documents). Either way the shards record the
file's SHA-256, so shards of another tokenizer are refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from trainplan.errors import SpecError

EOS = "<|endoftext|>"
MIN_VOCAB = 256 + 1  # the bytes and EOS
MAX_VOCAB = 2**32 - 1  # token ids are stored as uint32 at most (`shards`)


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load(path: str | Path):
    """The `tokenizers.Tokenizer` of `path`, with an end-of-document token; else one line."""
    from tokenizers import Tokenizer  # tokenizers: loaded only when data is prepared

    path = Path(path)
    if not path.is_file():
        raise SpecError(f"--tokenizer {str(path)!r}: no such file")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises its own Exception type for a bad file
        first = (str(err).splitlines() or [type(err).__name__])[0][:120]
        raise SpecError(f"--tokenizer {str(path)!r} is not a tokenizers tokenizer.json "
                        f"({first})") from None
    eos_id(tok, path)
    return tok


def eos_id(tok, path) -> int:
    """The id the tokenizer gives `EOS` (or to its first special token); one line if none."""
    for name in (EOS, "</s>", "<eos>", "<|end_of_text|>"):
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    raise SpecError(f"tokenizer {str(path)!r} has no end-of-document token ({EOS!r}, '</s>', "
                    "'<eos>' or '<|end_of_text|>'); add one as a special token")


def train(texts: Iterator[str], vocab_size: int, out: Path):
    """A byte-level BPE of `vocab_size` ids trained on `texts`, saved to `out`; returned."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not MIN_VOCAB <= vocab_size <= 2**20:
        raise SpecError(f"--vocab-size {vocab_size} is not valid; use {MIN_VOCAB} to "
                        f"{2**20} (the bytes and {EOS!r} at least)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return tok
