"""Precise prefix state from SGLang's KV-cache events.

An engine started with `--kv-events-config` publishes, over ZeroMQ, every page its radix
cache stores or evicts, named by a chained hash of the page's token ids. The gateway
subscribes to every engine it routes to (`streams.py`), keeps an exact index of which
replica holds which page (`index.py`), and hashes each prompt the same way (`hashing.py`,
from token ids the model's own tokenizer produces: `prompts.py`), so the routing policy
knows, not guesses, how much of a prompt each replica has cached.
"""
