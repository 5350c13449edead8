"""The tokenizer: a Hugging Face `tokenizers` `tokenizer.json`, given or trained here.

A team brings the tokenizer of its model (`load`), or trains a byte-level BPE on its
corpus (`train`: byte-level pre-tokenisation, so that every text encodes with no unknown
token, pieces of at most `MAX_PIECE` bytes, and `EOS` as the special token between
documents). Either way the shards record the file's SHA-256, so shards of another
tokenizer are refused.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from trainplan.errors import SpecError
from trainplan.loader import quote

EOS = "<|endoftext|>"
MIN_VOCAB = 256 + 1  # the bytes and EOS
MAX_VOCAB = 2**32 - 1  # token ids are stored as uint32 at most (`shards`)
MAX_PIECE = 256  # bytes of one pre-token: the BPE trainer's time grows with its square


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load(path: str | Path):
    """The `tokenizers.Tokenizer` of `path`, with an end-of-document token; else one line."""
    from tokenizers import Tokenizer  # tokenizers: loaded only when data is prepared

    path = Path(path)
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            open(path, "rb").close()  # one this user cannot read is named here
    except (FileNotFoundError, NotADirectoryError):
        raise SpecError(f"--tokenizer {quote(str(path))}: no such file; give the model's "
                        "tokenizer.json") from None
    except (OSError, ValueError) as err:  # a name too long, no permission; a NUL byte
        raise SpecError(f"--tokenizer {quote(str(path))} cannot be read "
                        f"({getattr(err, 'strerror', None) or 'not a path'})") from None
    if stat.S_ISDIR(mode):
        raise SpecError(f"--tokenizer {quote(str(path))} is a folder; give the tokenizer.json "
                        "file itself")
    if not stat.S_ISREG(mode):
        raise SpecError(f"--tokenizer {quote(str(path))} is not a regular file; give the "
                        "model's tokenizer.json")
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


def framing(tok) -> tuple[int, int]:
    """How many ids `tok` adds before and after the ids of each text it encodes (its
    post-processor's, such as a beginning-of-text id): a document encoded in pieces keeps
    them at its start and end only."""
    mask = tok.encode("a").special_tokens_mask
    lead = next((i for i, m in enumerate(mask) if not m), len(mask))
    return lead, next((i for i, m in enumerate(reversed(mask)) if not m), 0)


def train(texts: Iterator[str], vocab_size: int, out: Path | None = None):
    """A byte-level BPE of `vocab_size` ids trained on `texts` (saved to `out` if given).

    Text is cut where GPT-2's pattern cuts it (words, numbers, punctuation, spaces), and a
    run longer than `MAX_PIECE` bytes (a row of dashes, letters with no space) into pieces of
    that many: training time stays linear in the text, and no token is longer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if not MIN_VOCAB <= vocab_size <= 2**20:
        raise SpecError(f"--vocab-size {vocab_size} is not valid; use {MIN_VOCAB} to "
                        f"{2**20} (the bytes and {EOS!r} at least)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False),  # one character a byte from here
        pre_tokenizers.Split(Regex(f".{{1,{MAX_PIECE}}}"), behavior="isolated")])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(out))
    return tok
