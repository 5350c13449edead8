"""The proxy training harness: model, layouts, data, loop, records (see README.md)."""
