"""Records of runs: the schema, provenance and the statistics of measured steps."""
