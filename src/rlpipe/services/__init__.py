"""Thin HTTP layers for rlpipe's services (only where the engine has none of its own)."""
