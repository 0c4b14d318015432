"""Fault injection and a recording load client, usable against any running daemon."""
