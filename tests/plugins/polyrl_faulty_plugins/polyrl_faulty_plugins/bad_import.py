"""A plugin whose import raises (a missing vendor library, a syntax error in a new release...)."""

raise ImportError("planted import failure")
