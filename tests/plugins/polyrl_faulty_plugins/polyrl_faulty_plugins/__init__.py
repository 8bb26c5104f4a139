"""Plugins that fail: at import, in a registration hook, by a misspelt hook, by taking a name already taken, in
``detect()``, and by a kernel path that does not resolve."""
