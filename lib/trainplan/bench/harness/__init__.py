"""The proxy training harness: model, parallelisation, step, data, the timed run."""
