"""Shared test helpers: oracles, model / engine / server builders, kernel cases. Test files import from
here, never from each other."""
