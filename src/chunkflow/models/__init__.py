"""Adapters from diffusers classes to block lists, input builders and model builders/loaders."""
