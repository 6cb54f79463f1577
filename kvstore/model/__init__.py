"""Running models: the public ``Adapter``, building and decoding, preallocated caches, model
loading (hub, directories, GGUF), GGUF metadata and model fingerprints.
"""
