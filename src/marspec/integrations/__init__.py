"""Integrations of marspec's accept rules into other inference engines."""
