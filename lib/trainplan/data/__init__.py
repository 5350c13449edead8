"""A team's own data, from files to token shards the trainer reads.

    text / JSONL / parquet files (`corpus`) -> a `tokenizers` tokenizer, given or trained
    (`tokenize`) -> token shards on disk with an index (`shards`, the format) ->
    a deterministic, resumable sampler of fixed-length sequences (`sampler`)

`trainplan data prepare` runs the first three; the trainer reads the shards.

Instruction data: prompt/response records, made from the Python stdlib or a team's JSON
lines (`instruct`; `trainplan data instruct`) -> rows of (input_ids, labels) with the loss
on the responses only, packed or padded, tokenised where a row is read (`rows`; the proxy
harness's `--data instruct`).
"""
