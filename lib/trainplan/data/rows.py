"""Instruction records into training rows of (input_ids, labels), padded or packed.

A record is encoded as `PROMPT_TEMPLATE` around its prompt, then its response, then the
end-of-document id (`tokenize.eos_id`); the prompt and the response are encoded apart, so
the boundary between them is exact. Labels are the next ids, `IGNORE` (-100, which
`torch.nn.functional.cross_entropy` skips) wherever the next id is a prompt id or padding:
the loss is on the response and its end-of-document id only. A record longer than a row
(seq_len + 1 ids) is cut (`Encoder.cut`) so that a prompt never fills a row: every row has
a response id to learn.

Padded (`PaddedRows`): one record a row, padded on the right with the end-of-document id
to seq_len. To seq_len, not to the batch's longest record: every step has the same shape,
so a compiled model does not recompile per length and the planner's memory holds per step;
padding costs exactly its share of each row, which the trained share of a step measures.

Packed (`PackedRows`): records one after another in a stream, cut into rows of seq_len
inputs (neighbours share one boundary id, as `bench.harness.data.PackedDataset`); every
row is full and every response id is a label exactly once. Attention is plain causal over
the row, so a record sees the records before it in its row (positions are not reset). That
is the common practice: a block-causal mask would keep records apart but takes SDPA off its
flash kernel (no arbitrary masks there), which would change the speed this study measures.
No loss crosses a record boundary: the first id of a record is a prompt id, never a label.

Ids are made where a row is read (`__getitem__`): in the DataLoader's workers when it has
any. Packing needs each record's length to place rows, measured once with `encode_batch`.
Items are numpy int64 arrays; the DataLoader's default collate makes tensors of them.
"""

from __future__ import annotations

import numpy as np

from trainplan.data import tokenize

IGNORE = -100  # the label of a position without loss
PROMPT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"


class Encoder:
    """A record's ids and which of them are trained, cut to `budget` ids; the tokenizer is
    loaded in the process that first encodes (a DataLoader worker), from its file."""

    def __init__(self, tokenizer_file: str, budget: int):
        self.file, self.budget, self._tok, self.eos = str(tokenizer_file), budget, None, None

    def __getstate__(self) -> dict:  # workers started by spawn load their own tokenizer
        return {**self.__dict__, "_tok": None}

    def tokenizer(self):
        if self._tok is None:
            self._tok = tokenize.load(self.file)
            self._tok.encode_special_tokens = True  # a text's "<|endoftext|>" is text
            self.eos = tokenize.eos_id(self._tok, self.file)
        return self._tok

    def pair(self, record: dict) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids + end-of-document id), uncut."""
        tok = self.tokenizer()
        prompt = tok.encode(PROMPT_TEMPLATE.format(prompt=record["prompt"])).ids
        return prompt, tok.encode(record["response"]).ids + [self.eos]

    def cut(self, prompt: list[int], response: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, trained) of at most `budget` ids. A record too long keeps its whole
        response after the prompt's head where the response fits in half the budget, else
        half the budget of prompt and the response's head: a prompt run is < budget - 1."""
        if len(prompt) + len(response) > self.budget:
            prompt = prompt[:max(self.budget - len(response), self.budget // 2)]
            response = response[:self.budget - len(prompt)]
        ids = np.asarray(prompt + response, dtype=np.int64)
        trained = np.zeros(len(ids), dtype=bool)
        trained[len(prompt):] = True
        return ids, trained

    def encode(self, record: dict) -> tuple[np.ndarray, np.ndarray]:
        return self.cut(*self.pair(record))

    def lengths(self, records: list[dict], batch: int = 1024) -> np.ndarray:
        """Each record's id count after the cut (encoded in parallel batches)."""
        tok, out = self.tokenizer(), []
        for i in range(0, len(records), batch):
            part = records[i:i + batch]
            prompts = tok.encode_batch([PROMPT_TEMPLATE.format(prompt=r["prompt"]) for r in part])
            responses = tok.encode_batch([r["response"] for r in part])
            out += [min(len(p.ids) + len(r.ids) + 1, self.budget)
                    for p, r in zip(prompts, responses, strict=True)]
        return np.asarray(out, dtype=np.int64)


def labels_of(ids: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """Next-id labels of ids[:-1]: ids[1:] where that id is trained, else IGNORE."""
    return np.where(trained[1:], ids[1:], IGNORE)


class PaddedRows:
    """Row i: record i, its (input_ids, labels) padded to `seq_len`."""

    def __init__(self, records: list[dict], tokenizer_file: str, seq_len: int):
        self.records, self.seq_len = records, seq_len
        self.encoder = Encoder(tokenizer_file, seq_len + 1)
        self.info = {"records": len(records), "rows": len(records), "pack": False}

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        ids, trained = self.encoder.encode(self.records[i])
        x = np.full(self.seq_len, self.encoder.eos, dtype=np.int64)
        y = np.full(self.seq_len, IGNORE, dtype=np.int64)
        x[:len(ids) - 1], y[:len(ids) - 1] = ids[:-1], labels_of(ids, trained)
        return x, y


class PackedRows:
    """Row i: ids [i seq_len, (i + 1) seq_len] of the records' stream (the last partial row
    dropped), as (input_ids, labels)."""

    def __init__(self, records: list[dict], tokenizer_file: str, seq_len: int):
        self.records, self.seq_len = records, seq_len
        self.encoder = Encoder(tokenizer_file, seq_len + 1)
        self.starts = np.concatenate([[0], np.cumsum(self.encoder.lengths(records))])
        self.info = {"records": len(records), "rows": len(self), "pack": True,
                     "stream_tokens": int(self.starts[-1])}

    def __len__(self) -> int:
        return max(0, int(self.starts[-1] - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = i * self.seq_len, (i + 1) * self.seq_len + 1  # stream ids [lo, hi)
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        last = int(np.searchsorted(self.starts, hi, side="left"))  # records first..last-1
        parts = [self.encoder.encode(self.records[k]) for k in range(first, last)]
        ids = np.concatenate([p[0] for p in parts])
        trained = np.concatenate([p[1] for p in parts])
        at = lo - int(self.starts[first])  # the row's first id within record `first`
        ids, trained = ids[at:at + self.seq_len + 1], trained[at:at + self.seq_len + 1]
        return ids[:-1], labels_of(ids, trained)


def make_rows(records: list[dict], tokenizer_file: str, seq_len: int, *, pack: bool):
    """Packed or padded rows of `records` (see the module docstring)."""
    return (PackedRows if pack else PaddedRows)(records, tokenizer_file, seq_len)
