"""Datasets, prompt templates and tokenizers."""
