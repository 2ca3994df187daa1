"""The KV cache: the block pool, one manager of block tables and lanes, the pools every
executor reads."""
