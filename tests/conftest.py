"""Suite-wide setup: third-party plugin autoload is off, so a plugin installed on this machine cannot
change results; tests that need a plugin turn it on (tests/plugins/test_plugins.py)."""

from __future__ import annotations

import os

os.environ["POLYRL_DISABLE_PLUGIN_AUTOLOAD"] = "1"
os.environ.pop("POLYRL_LOAD_PLUGINS", None)
os.environ.pop("POLYRL_BACKEND", None)
