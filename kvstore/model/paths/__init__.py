"""Cache paths (see :mod:`kvstore.model.paths.base`)."""
