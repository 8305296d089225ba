"""The one error a harvest job raises for what its user can fix (a bad source, argument or output folder)."""


class HarvestError(ValueError):
    """A harvest that cannot run as asked: the message names the offending value and what would be valid."""
