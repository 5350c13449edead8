"""The cost model: parameters, FLOPs, collectives, memory and step time of one layout, each
term a small named function."""
