"""KV-cache sizes: model shapes, estimates from them, and what a store measures. Imports no torch
unless a store is measured."""
