"""A team's own data, from files to token shards the trainer reads.

    text / JSONL / parquet files (`corpus`) -> a `tokenizers` tokenizer, given or trained
    (`tokenize`) -> token shards on disk with an index (`shards`, the format) ->
    a deterministic, resumable sampler of fixed-length sequences (`sampler`)

`trainplan data prepare` runs the first three; the trainer reads the shards.
"""
