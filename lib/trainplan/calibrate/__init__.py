"""Constants of a card fitted from its microbenchmark records."""
