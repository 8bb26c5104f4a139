"""polyrl's own backends. Each sub-package is an entry point of the ``polyrl.backends`` group."""
