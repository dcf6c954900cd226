"""noloco: decentralized, low-communication training of language models."""
