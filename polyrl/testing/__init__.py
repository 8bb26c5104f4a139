"""What plugin authors and polyrl's own tests reuse: the conformance kit, parity harness, emulators."""
