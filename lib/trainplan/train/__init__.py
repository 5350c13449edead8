"""Training the team's own model: data shards, the loop, checkpoints, export."""
