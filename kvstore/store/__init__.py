"""Where caches live: keys, the entry format, codecs, backends, scans, and the ``KVStore`` facade.

Nothing here runs a model. Submodules import what they need; importing this package is free.
"""
