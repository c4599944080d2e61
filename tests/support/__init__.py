"""Helpers the tests share: tiny models, reference outputs, a real server, a tensor-parallel rank."""
